"""The proxy's trace records (appliance.proxy.tracing.RequestTrace) as OTLP spans: the
writer the span exporter process runs (appliance.observability.exportproc).

It runs once for every request traced, on a core the proxy's load generator, upstreams or
other work also want, so a request's spans are written in as few Python operations as it
takes: one `struct` head per span (ids and times), blocks that many requests share cached
whole (a call's name and node; the request's name, route, status, path and split; token
counts; an id attribute's head for each length), span frames looked up, and one join for
the whole request. The same spans built as opentelemetry-proto messages cost about six
times the CPU (bench/span_encode.py), and written span by span with otlpwire's helpers
1.4 times."""

from __future__ import annotations

import time
from typing import Any

from appliance.observability import otlpwire as wire
from appliance.proxy.tracing import CALL_FIELDS

_REQUEST = wire.name_kind("pd.request", wire.KIND_SERVER)
_REQUEST_ID, _TRANSFER_ID = wire.Key("pd.request_id"), wire.Key("pd.transfer_id")
_OUTPUT, _PROMPT = wire.Key("pd.output_tokens"), wire.Key("pd.prompt_tokens")
_CACHE_MAX = 4096  # entries of a cache of values (nodes, routes, token counts) at most
# otlpwire's span heads and tags, bound here: read for every span.
_CHILD_HEAD, _ROOT_HEAD = wire.CHILD_HEAD, wire.ROOT_HEAD
_TRACE_TAG, _ID_TAG, _PARENT_TAG = wire.TRACE_ID_TAG, wire.SPAN_ID_TAG, wire.PARENT_TAG
_START_TAG, _END_TAG = wire.START_TAG, wire.END_TAG
_FRAMED = 1 << 14  # spans shorter than this have their frame looked up


class SpanWriter:
    """A request's record (as RequestTrace.finish lays it out) as its spans' bytes: the
    request's own, then one per call, children of it. Records cross the pipe as msgpack, so
    tuples arrive as lists; the trace id and the span ids' stem travel as the calls'
    traceparent prefix ("00-<trace id>-<stem>"), clock readings as numbers, monotonic (the
    request's start in seconds, the rest in ns; the monotonic clock is the host's, so this
    process's offset makes them the epoch's)."""

    resource = {"service.name": "pd-proxy"}
    scope = "appliance.proxy"

    @staticmethod
    def spans(raw: Any) -> int:
        return 1 + len(raw[-1]) // CALL_FIELDS  # the request's, and one per call

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], bytes] = {}  # a call's name, kind and node
        self._requests: dict[tuple[Any, ...], bytes] = {}  # the request's shared fields
        self._counts: dict[tuple[wire.Key, int], bytes] = {}  # token count attributes
        # A span's frame (its tag and length) for each length under _FRAMED.
        self._frames = [wire.span_frame(n) for n in range(_FRAMED)]

    def _call(self, role: str, url: str) -> bytes:
        out = wire.name_kind(f"pd.{role}", wire.KIND_CLIENT) + wire.attr("pd.node", url)
        return _bounded(self._calls, (role, url), out)

    def _request(self, key: tuple[Any, ...]) -> bytes:
        route, status, path, where, reason = key
        split = b"" if where is None else wire.attr("pd.split", f"{where}:{reason}")
        out = b"".join((_REQUEST, wire.attr("http.route", route),
                        wire.attr("http.status_code", status), wire.attr("pd.path", path),
                        split))
        return _bounded(self._requests, key, out)

    def _count(self, key: wire.Key, n: int) -> bytes:
        out = self._counts.get((key, n))
        return out if out is not None else _bounded(self._counts, (key, n), key.int(n))

    def encode(self, raw: Any) -> bytes:
        (parent, started, end_ns, request_id, route, status, path, transfer_id,
         output, prompt, where, reason, fallback, error, calls) = raw
        wall = time.time_ns() - time.monotonic_ns()
        trace_id = bytes.fromhex(parent[3:35])
        span_id = bytes.fromhex(parent[36:] + "0")
        stem, low = span_id[:7], span_id[7]  # a call's span id: its index + 1 in low's digit
        rid = _REQUEST_ID.str(request_id)
        ids = rid + _TRANSFER_ID.str(transfer_id) if transfer_id else rid
        frames, known, pack = self._frames, self._calls, _CHILD_HEAD.pack
        out: list[bytes] = []
        i = 0
        it = iter(calls)
        for role, url, call_xfer, start, end in zip(it, it, it, it, it, strict=True):
            i += 1
            fixed = known.get((role, url)) or self._call(role, url)
            tail = ids if call_xfer == transfer_id else (  # a call before the transfer's name
                rid + _TRANSFER_ID.str(call_xfer) if call_xfer else rid)
            n = _CHILD_HEAD.size + len(fixed) + len(tail)
            out += (frames[n] if n < _FRAMED else wire.span_frame(n),
                    pack(_TRACE_TAG, trace_id, _ID_TAG, stem, low | i, _PARENT_TAG, span_id,
                         _START_TAG, start + wall, _END_TAG, (end or end_ns) + wall),
                    fixed, tail)
        key = (route, status, path, where, reason)
        fixed = self._requests.get(key) or self._request(key)
        extra = self._count(_OUTPUT, output)
        if fallback:
            extra += wire.attr("pd.fallback", fallback)
        if prompt:
            extra += self._count(_PROMPT, prompt)
        if error is not None:
            extra += wire.error_status(error)
        n = _ROOT_HEAD.size + len(fixed) + len(ids) + len(extra)
        out += (frames[n] if n < _FRAMED else wire.span_frame(n),
                _ROOT_HEAD.pack(_TRACE_TAG, trace_id, _ID_TAG, span_id, _START_TAG,
                                round(started * 1e9) + wall, _END_TAG, end_ns + wall),
                fixed, ids, extra)
        return b"".join(out)


def _bounded(cache: dict[Any, bytes], key: Any, value: bytes) -> bytes:
    """`value`, kept under `key` in a cache emptied when it reaches _CACHE_MAX."""
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value
