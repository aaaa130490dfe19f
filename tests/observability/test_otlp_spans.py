"""The proxy's own OTLP writer (appliance.observability.otlpwire) and batch exporter
(otlpexport): what it writes decodes with opentelemetry-proto field by field, and what it
sends reaches real OTLP/HTTP and OTLP/gRPC receivers, batched, bounded and counted."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from appliance.observability import otlpexport, otlpwire
from appliance.observability.otlpexport import SpanExport, parse_headers
from tests.conftest import free_port
from tests.otlp import Collector, GrpcCollector

TRACE, SPAN, PARENT = bytes(range(1, 17)), bytes(range(20, 28)), bytes(range(40, 48))


def _one(trace: bytes = TRACE, span: bytes = SPAN, **kw) -> bytes:
    return otlpwire.span(trace, span, kw.pop("parent", PARENT),
                         otlpwire.name_kind(kw.pop("name", "pd.decode"), otlpwire.KIND_CLIENT),
                         kw.pop("start", 1_700_000_000_000_000_001),
                         kw.pop("end", 1_700_000_000_500_000_002),
                         kw.pop("attrs", b""), kw.pop("error", None))


def test_a_span_decodes_field_by_field() -> None:
    attrs = b"".join((otlpwire.attr("pd.node", "http://10.0.0.2:8100"),
                      otlpwire.attr("pd.request_id", "r" * 300),  # a length over one byte
                      otlpwire.attr("pd.output_tokens", 1 << 40),
                      otlpwire.attr("pd.delta", -7), otlpwire.attr("pd.ok", True)))
    body = otlpwire.request({"service.name": "pd-proxy", "pd.pid": 42}, "appliance.proxy",
                            [_one(attrs=attrs), _one(parent=None, name="pd.request",
                                                     error="upstream 503")])
    req = ExportTraceServiceRequest.FromString(body)
    (rs,) = req.resource_spans
    assert {a.key: a.value for a in rs.resource.attributes}["service.name"].string_value \
        == "pd-proxy"
    assert rs.resource.attributes[1].value.int_value == 42
    (ss,) = rs.scope_spans
    assert ss.scope.name == "appliance.proxy"
    child, root = ss.spans
    assert (child.trace_id, child.span_id, child.parent_span_id) == (TRACE, SPAN, PARENT)
    assert child.name == "pd.decode" and child.kind == otlpwire.KIND_CLIENT
    assert child.start_time_unix_nano == 1_700_000_000_000_000_001
    assert child.end_time_unix_nano == 1_700_000_000_500_000_002
    got = {a.key: a.value for a in child.attributes}
    assert got["pd.node"].string_value == "http://10.0.0.2:8100"
    assert got["pd.request_id"].string_value == "r" * 300
    assert got["pd.output_tokens"].int_value == 1 << 40
    assert got["pd.delta"].int_value == -7
    assert got["pd.ok"].bool_value is True
    assert child.status.code == 0
    assert root.parent_span_id == b"" and root.name == "pd.request"
    assert root.status.code == 2 and root.status.message == "upstream 503"


def test_headers_are_read_as_opentelemetry_writes_them() -> None:
    assert parse_headers("Authorization=Bearer%20k1, x-tenant = a=b ,bad,") == {
        "authorization": "Bearer k1", "x-tenant": "a=b"}


@pytest.mark.parametrize("receiver", [Collector, GrpcCollector], ids=["http", "grpc"])
async def test_spans_reach_a_real_receiver_in_bounded_batches(receiver, monkeypatch) -> None:
    env = {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "6",
           "OTEL_EXPORTER_OTLP_HEADERS": "x-team=sre", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}
    with receiver() as r:
        protocol = "grpc" if receiver is GrpcCollector else "http/protobuf"
        export = SpanExport(r.url, protocol, {"service.name": "pd-proxy"}, "t", env)
        export.start()

        async def request(i: int) -> None:  # one request's three spans
            export.add(b"".join(_one(span=bytes([i, k] * 4)) for k in range(3)), 3)
            await asyncio.sleep(0.3)

        await request(0)
        assert r.spans == []  # below a batch, before the schedule: nothing sent yet
        await request(1)
        assert len(r.spans) == 6  # a whole batch goes at once
        await request(2)
        await export.close()  # sends the rest
    assert len(r.spans) == 9 and export.counts == {"exported": 9, "dropped": 0}
    assert len(r.exports) == 2 and all(h["x-team"] == "sre" for h in r.exports)
    if receiver is Collector:
        assert all(h["content-encoding"] == "gzip" for h in r.exports)
    assert {s.service for s in r.spans} == {"pd-proxy"}


async def test_a_full_queue_drops_new_spans_and_counts_them() -> None:
    env = {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_QUEUE_SIZE": "6",
           "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100"}
    with Collector() as r:
        export = SpanExport(r.url, "http/protobuf", {"service.name": "x"}, "t", env)
        export.start()
        for _ in range(3):
            export.add(_one() * 3, 3)
        await export.close()
    assert export.counts == {"exported": 6, "dropped": 3} and len(r.spans) == 6


async def test_a_collector_that_is_not_there_costs_a_dropped_batch(monkeypatch) -> None:
    monkeypatch.setattr(otlpexport, "_RETRY_AFTER_S", 0.01)
    url = f"http://127.0.0.1:{free_port()}/v1/traces"
    for protocol in ("http/protobuf", "grpc"):
        export = SpanExport(url, protocol, {"service.name": "x"}, "t",
                            {"OTEL_EXPORTER_OTLP_TIMEOUT": "2"})
        export.start()
        export.add(_one(), 1)
        await export.close()
        assert export.counts == {"exported": 0, "dropped": 1}, protocol


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="grpc, http/protobuf"):
        SpanExport("http://127.0.0.1:4317", "http/json", {}, "t", {})


def test_settings_that_are_not_numbers_are_named_and_the_defaults_taken(caplog) -> None:
    export = SpanExport("http://127.0.0.1:4318/v1/traces", "http/protobuf", {}, "t", {
        "OTEL_BSP_SCHEDULE_DELAY": "soon", "OTEL_BSP_MAX_QUEUE_SIZE": "-5",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64", "OTEL_EXPORTER_OTLP_TIMEOUT": "0"})
    assert (export.delay_s, export.max_queue, export.max_batch, export.timeout_s) == \
        (5.0, 2048, 64, 10.0)
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("OTEL_BSP_SCHEDULE_DELAY='soon'", "OTEL_BSP_MAX_QUEUE_SIZE='-5'",
                 "OTEL_EXPORTER_OTLP_TIMEOUT='0'"):
        assert name in warned


@pytest.mark.parametrize("turns", range(6))
async def test_close_ends_the_sender_however_a_wake_and_the_close_meet(turns) -> None:
    """A close that lands as a full batch wakes the sender (any number of loop turns after)
    still ends it: Python 3.11's wait_for loses a cancel that meets its inner wait's end,
    and a sender stopped by cancelling alone ran on, and its process never exited."""
    env = {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
    with Collector() as r:
        export = SpanExport(r.url, "http/protobuf", {"service.name": "x"}, "t", env)
        export.start()
        await asyncio.sleep(0.05)
        export.add(_one(), 1)
        for _ in range(turns):
            await asyncio.sleep(0)
        await asyncio.wait_for(export.close(), 5)
    assert export.counts == {"exported": 1, "dropped": 0} and len(r.spans) == 1
