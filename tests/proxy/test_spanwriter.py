"""The span exporter's writer (appliance.proxy.spanwriter): every shape of record the proxy
sends decodes with opentelemetry-proto into the spans it describes, field by field."""

from __future__ import annotations

import itertools
import time

import msgspec
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span, Status

from appliance.proxy.spanwriter import SpanWriter

TRACE = "0af7651916cd43dd8448eb211c80319c"
STEM = TRACE[17:]  # the request's span id less its last digit (0)


def record(*, request_id: str = "req-1", transfer_id: str = "xfer-req-1",
           calls: list | None = None, output: int = 16, prompt: int = 30,
           where: str | None = None, reason: str | None = None, fallback: str | None = None,
           error: str | None = None, status: int = 200) -> list:
    """A record as it crosses the exporter's pipe (RequestTrace.finish's layout)."""
    raw = (f"00-{TRACE}-{STEM}", 100.5, 100_900_000_000, request_id, "/v1/completions", status,
           "split", transfer_id, output, prompt, where, reason, fallback, error,
           calls if calls is not None else [
               "prefill", "http://p:8100", transfer_id, 100_600_000_000, 100_700_000_000,
               "decode", "http://d:8200", transfer_id, 100_650_000_000, 0])
    return msgspec.msgpack.decode(msgspec.msgpack.encode(raw))


def spans(raw: list) -> dict[str, list[Span]]:
    writer = SpanWriter()
    assert writer.spans(raw) == 1 + len(raw[-1]) // 5
    out: dict[str, list[Span]] = {}
    for s in ScopeSpans.FromString(writer.encode(raw)).spans:
        out.setdefault(s.name, []).append(s)
    return out


def attrs(span: Span) -> dict[str, str | int]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_a_split_request_is_its_span_and_one_per_call_with_ids_and_times() -> None:
    got = spans(record())
    (root,), (p,), (d,) = got["pd.request"], got["pd.prefill"], got["pd.decode"]
    assert root.trace_id.hex() == TRACE and root.span_id.hex() == STEM + "0"
    assert not root.parent_span_id and root.kind == Span.SPAN_KIND_SERVER
    assert [p.span_id.hex(), d.span_id.hex()] == [STEM + "1", STEM + "2"]
    assert all(s.parent_span_id == root.span_id and s.trace_id == root.trace_id
               and s.kind == Span.SPAN_KIND_CLIENT for s in (p, d))
    wall = time.time_ns() - time.monotonic_ns()
    assert abs(root.start_time_unix_nano - (100_500_000_000 + wall)) < 1e8
    assert p.end_time_unix_nano - p.start_time_unix_nano == 100_000_000
    assert d.end_time_unix_nano == root.end_time_unix_nano  # D's call ends with the request
    assert attrs(root) == {"http.route": "/v1/completions", "http.status_code": 200,
                           "pd.path": "split", "pd.request_id": "req-1",
                           "pd.transfer_id": "xfer-req-1", "pd.output_tokens": 16,
                           "pd.prompt_tokens": 30}
    assert attrs(p) == {"pd.node": "http://p:8100", "pd.request_id": "req-1",
                        "pd.transfer_id": "xfer-req-1"}
    assert root.status.code == Status.STATUS_CODE_UNSET


@pytest.mark.parametrize("request_id, transfer_id", [
    ("r" * 200, "x" * 130),  # lengths over one varint byte, spans over 127 bytes
    ("é" * 90, "ü" * 5),  # lengths in bytes, not characters
    ("req-1", ""),  # no transfer named (D alone)
    ("r" * 9000, "x" * 9000),  # spans past the frames looked up
])
def test_ids_of_any_length_and_script_are_written_whole(request_id: str,
                                                        transfer_id: str) -> None:
    got = spans(record(request_id=request_id, transfer_id=transfer_id))
    for s in itertools.chain(*got.values()):
        a = attrs(s)
        assert a["pd.request_id"] == request_id
        assert a.get("pd.transfer_id", "") == transfer_id


def test_a_call_made_before_the_transfer_was_named_carries_its_own() -> None:
    calls = ["decode", "http://d:8200", "", 100_600_000_000, 100_700_000_000,
             "prefill", "http://p:8100", "xfer-old", 100_610_000_000, 100_620_000_000,
             "decode", "http://d:8200", "xfer-new", 100_700_000_000, 0]
    got = spans(record(transfer_id="xfer-new", calls=calls))
    first, second = got["pd.decode"]
    assert "pd.transfer_id" not in attrs(first)
    assert attrs(got["pd.prefill"][0])["pd.transfer_id"] == "xfer-old"
    assert attrs(second)["pd.transfer_id"] == "xfer-new"
    assert sorted(s.span_id.hex()[-1] for s in itertools.chain(*got.values())) == \
        ["0", "1", "2", "3"]


def test_a_failed_request_has_an_error_status_its_fallback_and_its_split() -> None:
    got = spans(record(status=502, error="upstream 502: é", fallback="decode_down",
                       where="d", reason="short_prompt", prompt=0, output=1 << 40))
    (root,) = got["pd.request"]
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert root.status.message == "upstream 502: é"
    a = attrs(root)
    assert a["pd.fallback"] == "decode_down" and a["pd.split"] == "d:short_prompt"
    assert a["pd.output_tokens"] == 1 << 40 and "pd.prompt_tokens" not in a
    assert a["http.status_code"] == 502


def test_cached_blocks_serve_many_requests_and_stay_bounded() -> None:
    """Nodes, routes and token counts are written once and reused; past the cache's size it
    starts again rather than grow with every count a client asks for."""
    writer = SpanWriter()
    for n in range(10_000):
        raw = record(output=n, prompt=n + 1)
        (root,) = [s for s in ScopeSpans.FromString(writer.encode(raw)).spans
                   if s.name == "pd.request"]
        if n % 997 == 0:
            assert attrs(root)["pd.output_tokens"] == n
            assert attrs(root)["pd.prompt_tokens"] == n + 1
    assert len(writer._counts) <= 4096 and len(writer._calls) == 2
