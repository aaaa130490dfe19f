"""Traces (appliance.proxy.tracing) exported to a real OTLP/HTTP receiver: one trace per
request, the request's span with a child per call to P and D, each call carrying its span's
W3C context; off unless an endpoint is set."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import psutil
import pytest

from appliance.observability import exportproc
from tests.otlp import Collector, GrpcCollector, span_id_of, trace_id_of
from tests.proxy.conftest import MakeCluster, until

STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}


@pytest.fixture
def collector(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within moments
    with Collector() as c:
        yield c


async def test_a_split_request_is_one_trace_with_a_span_per_call(make_cluster: MakeCluster,
                                                                collector: Collector) -> None:
    c = await make_cluster(otlp_traces_endpoint=collector.url,
                           otlp_traces_protocol="http/protobuf")
    status, data, _ = await c.post()
    assert status == 200
    (p,), (d,) = c.prefill[0].received, c.decode[0].received
    p_parent, d_parent = p.headers["traceparent"], d.headers["traceparent"]
    trace_id = trace_id_of(p_parent)
    assert trace_id_of(d_parent) == trace_id
    spans = {s.name: s for s in await collector.wait_async(trace_id, {"pd.request", "pd.prefill",
                                                            "pd.decode"})}
    root, prefill, decode = spans["pd.request"], spans["pd.prefill"], spans["pd.decode"]
    assert root.parent_id == "" and root.service == "pd-proxy"
    assert prefill.parent_id == decode.parent_id == root.span_id
    # P's and D's own spans (vLLM's llm_request, the connector's) hang under these.
    assert (span_id_of(p_parent), span_id_of(d_parent)) == (prefill.span_id, decode.span_id)
    xfer = p.kv["transfer_id"]
    assert root.attributes["pd.transfer_id"] == prefill.attributes["pd.transfer_id"] == xfer
    assert root.attributes["pd.request_id"] == p.headers["X-Request-Id"]
    assert root.attributes["http.status_code"] == 200
    assert root.attributes["pd.path"] == "split"
    assert prefill.attributes["pd.node"] == c.prefill[0].url
    assert root.start_ns <= prefill.start_ns <= prefill.end_ns <= root.end_ns
    assert root.start_ns <= decode.start_ns <= decode.end_ns <= root.end_ns
    # P's call ends when P answered (Record.prefilled_at), before D's answer is relayed.
    assert prefill.end_ns < decode.end_ns


async def test_a_first_token_stream_and_a_fallback_are_traced(make_cluster: MakeCluster,
                                                             collector: Collector) -> None:
    c = await make_cluster(otlp_traces_endpoint=collector.url,
                           otlp_traces_protocol="http/protobuf", first_token_from_prefill=True)
    async with c.http.post(f"{c.url}/v1/completions", json=STREAM) as r:
        assert r.status == 200
        await r.read()
    trace_id = trace_id_of(c.prefill[0].received[0].headers["traceparent"])
    names = [s.name for s in await collector.wait_async(trace_id, {"pd.request", "pd.prefill",
                                                        "pd.decode"})]
    assert sorted(names) == ["pd.decode", "pd.prefill", "pd.request"]
    await c.prefill[0].stop()  # P unreachable: D alone answers, in the same kind of trace
    status, _, _ = await c.post()
    assert status == 200
    d = c.decode[0].received[-1]
    spans = await collector.wait_async(trace_id_of(d.headers["traceparent"]),
                                       {"pd.request", "pd.decode"})
    root = next(s for s in spans if s.name == "pd.request")
    assert root.attributes["pd.path"] == "d_alone" and "pd.fallback" in root.attributes


async def test_off_by_default_nothing_is_sent(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    status, _, _ = await c.post()
    assert status == 200
    assert "traceparent" not in c.prefill[0].received[0].headers
    assert "traceparent" not in c.decode[0].received[0].headers


async def test_an_unsampled_request_carries_an_unsampled_context_and_records_nothing(
        make_cluster: MakeCluster, collector: Collector) -> None:
    """--otlp-traces-sample-ratio: the proxy decides for the whole trace; a request it does
    not trace tells P and D so (sampled flag off), or vLLM would start a trace of its own."""
    c = await make_cluster(otlp_traces_endpoint=collector.url,
                           otlp_traces_protocol="http/protobuf", otlp_traces_sample_ratio=0.0)
    status, _, _ = await c.post()
    assert status == 200
    p, d = c.prefill[0].received[0].headers["traceparent"], \
        c.decode[0].received[0].headers["traceparent"]
    assert p.endswith("-00") and d.endswith("-00") and trace_id_of(p) == trace_id_of(d)
    assert span_id_of(p) != span_id_of(d)
    await c.proxy.close()  # flushes whatever was recorded: nothing
    assert collector.spans == []


async def test_the_default_protocol_is_grpc_and_exported_spans_are_counted(
        make_cluster: MakeCluster, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with GrpcCollector() as collector:
        c = await make_cluster(otlp_traces_endpoint=collector.url)
        for _ in range(2):
            status, _, _ = await c.post()
            assert status == 200
        trace_id = trace_id_of(c.decode[0].received[-1].headers["traceparent"])
        await collector.wait_async(trace_id, {"pd.request", "pd.prefill", "pd.decode"})
        await collector.wait_async(trace_id_of(c.decode[0].received[0].headers["traceparent"]),
                                   {"pd.request"})
        # The exporter process reports what it sent a moment after the collector has it.
        text = await _metrics_until(c, 'pd_proxy_trace_spans_total{outcome="exported"} 6.0')
    assert 'pd_proxy_trace_spans_total{outcome="dropped"} 0.0' in text


async def _metrics_until(c, line: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        async with c.http.get(f"{c.url}/metrics") as r:
            text = await r.text()
        if line in text or time.monotonic() > deadline:
            assert line in text, text
            return text
        await asyncio.sleep(0.05)


def _exporter(c) -> psutil.Process:
    """The proxy's span exporter process (appliance.observability.exportproc)."""
    proc = c.proxy.proxy.tracing.export._proc
    assert proc is not None
    return psutil.Process(proc.pid)


async def test_spans_are_sent_by_a_process_that_ends_with_the_proxy_after_sending_them(
        make_cluster: MakeCluster, monkeypatch) -> None:
    """The exporter sends what the proxy recorded before it closed (a schedule far longer
    than the test: only the close sends them), then exits."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    with Collector() as collector:
        c = await make_cluster(otlp_traces_endpoint=collector.url,
                               otlp_traces_protocol="http/protobuf")
        exporter = _exporter(c)
        assert exporter.pid != os.getpid() and "appliance.observability.exportproc" in \
            " ".join(exporter.cmdline())
        proc = c.proxy.proxy.tracing.export._proc
        status, _, _ = await c.post()
        assert status == 200
        trace_id = trace_id_of(c.decode[0].received[0].headers["traceparent"])
        await c.proxy.close()
        assert {s.name for s in collector.spans if s.trace_id == trace_id} == \
            {"pd.request", "pd.prefill", "pd.decode"}
        assert proc.returncode == 0  # it ended, and with nothing wrong


async def test_an_exporter_that_dies_costs_spans_not_requests_and_is_started_again(
        make_cluster: MakeCluster, collector: Collector, monkeypatch) -> None:
    monkeypatch.setattr(exportproc, "RESTART_AFTER_S", 0.3)
    c = await make_cluster(otlp_traces_endpoint=collector.url,
                           otlp_traces_protocol="http/protobuf")
    first = _exporter(c)
    export = c.proxy.proxy.tracing.export
    first.kill()  # the proxy reaps its own child (a wait here would take that from it)
    await until(lambda: export._proc is None)
    status, _, _ = await c.post()  # recorded while no exporter runs: dropped, counted
    assert status == 200
    await _metrics_until(c, 'pd_proxy_trace_spans_total{outcome="dropped"} 3.0')
    deadline = time.monotonic() + 10
    while True:  # the next request's record finds it gone for long enough: a new one
        status, _, _ = await c.post()
        assert status == 200
        if export._proc is not None and export._proc.pid != first.pid:
            break
        assert time.monotonic() < deadline, "the exporter was not started again"
        await asyncio.sleep(0.1)
    status, _, _ = await c.post()
    assert status == 200
    trace_id = trace_id_of(c.decode[0].received[-1].headers["traceparent"])
    await collector.wait_async(trace_id, {"pd.request", "pd.prefill", "pd.decode"})


async def test_records_the_exporter_does_not_read_are_dropped_and_counted() -> None:
    """A pipe holding MAX_UNREAD bytes unread: the proxy writes no more and counts the spans
    dropped, holding nothing for the exporter."""
    export = exportproc.ExportProcess("http://127.0.0.1:1/v1/traces", "http/protobuf",
                                      "appliance.proxy.spanwriter:SpanWriter")
    written: list[bytes] = []
    unread = [0]
    pipe = SimpleNamespace(is_closing=lambda: False, write=written.append,
                           transport=SimpleNamespace(get_write_buffer_size=lambda: unread[0]))
    export._proc = SimpleNamespace(stdin=pipe)  # type: ignore[assignment]
    for _ in range(exportproc.FRAME_RECORDS):
        export.add(("00-" + "1" * 32 + "-",), 3)
    assert len(written) == 1 and export.counts["dropped"] == 0
    unread[0] = exportproc.MAX_UNREAD + 1
    for _ in range(exportproc.FRAME_RECORDS):
        export.add(("00-" + "1" * 32 + "-",), 3)
    assert len(written) == 1 and export.counts["dropped"] == 3 * exportproc.FRAME_RECORDS
    assert not export._records and export._starting is None


async def test_closing_with_no_exporter_drops_the_last_records_and_starts_none(
        monkeypatch) -> None:
    export = exportproc.ExportProcess("http://127.0.0.1:1/v1/traces", "http/protobuf",
                                      "appliance.proxy.spanwriter:SpanWriter")

    async def spawn() -> None:
        raise AssertionError("an exporter started while closing")

    monkeypatch.setattr(export, "_spawn", spawn)
    export.add(("00-" + "1" * 32 + "-",), 3)  # its exporter died long ago
    await export.close()
    assert export.counts["dropped"] == 3 and export._starting is None


async def test_span_ids_are_unique_in_a_trace_and_a_call_past_the_cap_joins_the_request() -> None:
    """One random number names a request's trace and spans: the calls' span ids differ from
    each other and from the request's; calls past MAX_CALLS carry the request's own span
    as their parent. The exporter's writer makes the spans the headers promised."""
    import msgspec
    from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

    from appliance.proxy.access import AccessRecord as Record
    from appliance.proxy.spanwriter import SpanWriter
    from appliance.proxy.tracing import MAX_CALLS, RequestTrace

    records: list[tuple] = []
    export = SimpleNamespace(add=lambda record, n: records.append((record, n)))
    rec = Record("/v1/completions", "req-1", time.monotonic())
    trace = RequestTrace(export)  # type: ignore[arg-type]
    parents = []
    for i in range(MAX_CALLS + 3):
        headers: dict[str, str] = {}
        trace.call("prefill" if i % 2 else "decode", "http://p", rec, headers)
        parents.append(headers["traceparent"])
    rec.status = 200
    trace.finish(rec)
    (raw, n), = records
    assert n == 1 + MAX_CALLS
    spans = ScopeSpans.FromString(SpanWriter().encode(msgspec.msgpack.decode(
        msgspec.msgpack.encode(raw))))  # as it crosses the exporter's pipe
    root, = [s for s in spans.spans if s.name == "pd.request"]
    calls = [s for s in spans.spans if s.name != "pd.request"]
    assert [s.span_id.hex() for s in calls] == [span_id_of(p) for p in parents[:MAX_CALLS]]
    assert len({root.span_id, *(s.span_id for s in calls)}) == 1 + MAX_CALLS
    assert all(s.parent_span_id == root.span_id and s.trace_id == root.trace_id
               and s.end_time_unix_nano >= s.start_time_unix_nano for s in calls)
    assert {span_id_of(p) for p in parents[MAX_CALLS:]} == {root.span_id.hex()}
    assert {trace_id_of(p) for p in parents} == {root.trace_id.hex()}
    assert abs(root.end_time_unix_nano - time.time_ns()) < 5e9


def test_a_random_stem_of_zeros_is_made_nonzero_as_w3c_asks(monkeypatch) -> None:
    """A trace id whose last 15 hex digits are zeros would give the request's span the one
    span id W3C rules out: its last digit becomes 1, in the trace id and the stem alike."""
    from appliance.proxy import tracing

    monkeypatch.setattr(tracing, "_hex", lambda n: "a" * 17 + "0" * 15)
    records: list[tuple] = []
    trace = tracing.RequestTrace(SimpleNamespace(add=lambda r, n: records.append(r)))  # type: ignore[arg-type]
    headers: dict[str, str] = {}
    trace.call("prefill", "http://p", SimpleNamespace(transfer_id="x"), headers)  # type: ignore[arg-type]
    assert headers["traceparent"] == f"00-{'a' * 17}{'0' * 14}1-{'0' * 14}11-01"
    assert trace_id_of(headers["traceparent"]) == "a" * 17 + "0" * 14 + "1"


def test_a_frame_is_one_msgpack_array_of_records_encoded_as_they_came() -> None:
    """The proxy encodes each record as its request ends and writes the array's header when
    the frame goes: what the exporter decodes is the list of records, at every header size."""
    import msgspec

    encode = msgspec.msgpack.encode
    for n in (0, 1, 15, 16, 300, 65_535, 65_536):
        records = [["00-" + f"{i:032x}-", i, None] for i in range(n)]
        body = exportproc._array_head(n) + b"".join(encode(r) for r in records)
        assert msgspec.msgpack.decode(body) == records


async def test_tracing_is_paused_resumed_and_resampled_at_runtime_through_the_admin_api(
        make_cluster: MakeCluster, collector: Collector, tmp_path) -> None:
    """PUT /admin/tracing (pdctl tracing): an incident's sampling without a restart."""
    from click.testing import CliRunner

    from appliance.pdctl.cli import cli
    from appliance.pdctl.node.localstate import LocalState

    c = await make_cluster(otlp_traces_endpoint=collector.url, backend_api_key="node-key",
                           otlp_traces_protocol="http/protobuf", otlp_traces_sample_ratio=0.0)
    run_dir = tmp_path / "run"
    (run_dir / "keys").mkdir(parents=True)
    (run_dir / "keys" / "api-key").write_text("node-key\n")
    LocalState(run_id="r", supervisor_pid=None, started_at=0.0, model="m",
               endpoints={"proxy": c.url}, services=[]).save(run_dir)

    def pdctl(*args: str):
        return CliRunner().invoke(cli, ["tracing", *args, "--local", "--run-dir", str(run_dir)])

    res = await asyncio.to_thread(pdctl)
    assert res.exit_code == 0, res.output
    assert f"tracing on, 0% of requests sampled, to {collector.url}" in res.output
    res = await asyncio.to_thread(pdctl, "--sample-ratio", "1")
    assert res.exit_code == 0 and "tracing on, 100% of requests sampled" in res.output
    assert (await c.post())[0] == 200
    traced = trace_id_of(c.decode[0].received[-1].headers["traceparent"])
    await collector.wait_async(traced, {"pd.request", "pd.prefill", "pd.decode"})
    res = await asyncio.to_thread(pdctl, "--off")
    assert res.exit_code == 0 and "tracing paused, 100%" in res.output, res.output
    assert (await c.post())[0] == 200  # paused: nothing recorded here or upstream
    # An unsampled context, not none: vLLM would trace a request without one as a root.
    for node in (c.prefill[0], c.decode[0]):
        assert node.received[-1].headers["traceparent"].endswith("-00")
    res = await asyncio.to_thread(pdctl, "--on")
    assert res.exit_code == 0 and "tracing on" in res.output
    assert (await c.post())[0] == 200
    assert c.decode[0].received[-1].headers["traceparent"].endswith("-01")
    # Bad input: a clear error, nothing changed.
    res = await asyncio.to_thread(pdctl, "--sample-ratio", "2")
    assert res.exit_code == 2 and "0<=x<=1" in res.output, res.output
    headers = {"Authorization": "Bearer node-key"}
    async with c.http.put(f"{c.url}/admin/tracing", json={"sample_ratio": -1},
                          headers=headers) as r:
        assert r.status == 400 and "sample_ratio" in (await r.json())["error"]["message"]
    async with c.http.put(f"{c.url}/admin/tracing", json={"ratio": 1}, headers=headers) as r:
        assert r.status == 400
    async with c.http.put(f"{c.url}/admin/tracing", json={"enabled": False}) as r:
        assert r.status == 401  # the node's key, as for drains
    async with c.http.get(f"{c.url}/admin/tracing", headers=headers) as r:
        assert (await r.json())["enabled"] is True


async def test_the_tracing_admin_api_says_tracing_is_off_without_an_endpoint(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    async with c.http.put(f"{c.url}/admin/tracing", json={"sample_ratio": 1}) as r:
        assert r.status == 409
        assert "no OTLP endpoint is set" in (await r.json())["error"]["message"]
