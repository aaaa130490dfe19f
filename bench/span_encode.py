"""What writing one traced request's spans costs the span exporter: the appliance's writer
(appliance/proxy/spanwriter.py) against the same spans built as opentelemetry-proto
messages and serialized, timed side by side on the same records.

    python bench/span_encode.py [--requests N] [--rounds R]

The records are what the proxy sends for a split request (its own span, P's call, D's
call), decoded from msgpack as the exporter gets them. The two ways' outputs are checked
to decode to the same spans before anything is timed."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span, Status  # noqa: E402

from appliance.proxy.spanwriter import SpanWriter  # noqa: E402
from appliance.proxy.tracing import CALL_FIELDS  # noqa: E402


def records(n: int) -> list[Any]:
    """`n` split requests' records, as they cross the exporter's pipe."""
    out = []
    now = time.monotonic_ns()
    for i in range(n):
        rid = f"chatcmpl-{os.urandom(16).hex()}"
        trace = os.urandom(16).hex()
        calls = ["prefill", "http://10.0.0.2:8100", f"xfer-{rid}", now + 1000, now + 90_000,
                 "decode", "http://10.0.0.3:8200", f"xfer-{rid}", now + 1500, 0]
        out.append((f"00-{trace}-{trace[17:]}", now / 1e9, now + 400_000, rid,
                    "/v1/chat/completions", 200, "split", f"xfer-{rid}", 16 + i % 500,
                    30 + i % 3000, None, None, None, None, calls))
    return msgspec.msgpack.decode(msgspec.msgpack.encode(out))


def _kv(key: str, value: str | int) -> KeyValue:
    any_value = AnyValue(int_value=value) if isinstance(value, int) else \
        AnyValue(string_value=value)
    return KeyValue(key=key, value=any_value)


def with_proto(raw: Any) -> bytes:
    """The same spans as opentelemetry-proto messages (its upb runtime), serialized."""
    (parent, started, end_ns, request_id, route, status, path, transfer_id,
     output, prompt, where, reason, fallback, error, calls) = raw
    wall = time.time_ns() - time.monotonic_ns()
    trace_id = bytes.fromhex(parent[3:35])
    span_id = bytes.fromhex(parent[36:] + "0")
    ids = [_kv("pd.request_id", request_id)] + (
        [_kv("pd.transfer_id", transfer_id)] if transfer_id else [])
    spans = []
    for i in range(0, len(calls), CALL_FIELDS):
        role, url, call_xfer, start, end = calls[i:i + CALL_FIELDS]
        spans.append(Span(
            trace_id=trace_id, span_id=span_id[:7] + bytes((span_id[7] | (i // 5 + 1),)),
            parent_span_id=span_id, name=f"pd.{role}", kind=Span.SPAN_KIND_CLIENT,
            start_time_unix_nano=start + wall, end_time_unix_nano=(end or end_ns) + wall,
            attributes=[_kv("pd.node", url), *ids]))
    attrs = [_kv("http.route", route), _kv("http.status_code", status), _kv("pd.path", path)]
    if where is not None:
        attrs.append(_kv("pd.split", f"{where}:{reason}"))
    attrs += [*ids, _kv("pd.output_tokens", output)]
    if fallback:
        attrs.append(_kv("pd.fallback", fallback))
    if prompt:
        attrs.append(_kv("pd.prompt_tokens", prompt))
    root = Span(trace_id=trace_id, span_id=span_id, name="pd.request",
                kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=round(started * 1e9) + wall,
                end_time_unix_nano=end_ns + wall, attributes=attrs)
    if error is not None:
        root.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message=error))
    spans.append(root)
    return ScopeSpans(spans=spans).SerializeToString()


def _same(a: bytes, b: bytes) -> bool:
    """Both decode to the same spans (times aside: each way reads the clock itself)."""
    def spans(body: bytes) -> list[Span]:
        out = list(ScopeSpans.FromString(body).spans)
        for s in out:
            s.start_time_unix_nano = s.end_time_unix_nano = 0
        return out
    return spans(a) == spans(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of each way")
    args = ap.parse_args()
    raws = records(args.requests)
    writer = SpanWriter()
    assert all(_same(writer.encode(r), with_proto(r)) for r in raws[:100])
    ways = {"appliance.proxy.spanwriter": writer.encode,
            "opentelemetry-proto (upb)": with_proto}
    best: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, encode in ways.items():
            t0 = time.perf_counter()
            for r in raws:
                encode(r)
            best[name].append((time.perf_counter() - t0) / len(raws))
    ours, theirs = (min(v) for v in best.values())
    for name, times in best.items():
        print(f"{name:28s} best {min(times) * 1e6:6.2f} µs/request, median "
              f"{statistics.median(times) * 1e6:6.2f} (3 spans each)")
    print(f"opentelemetry-proto / spanwriter: {theirs / ours:.1f}x the CPU")


if __name__ == "__main__":
    main()
