"""One client request as a trace: the request's span (`pd.request`) and a child for each
call to P or D (`pd.prefill`, `pd.decode`), whose W3C context goes with the call so that
vLLM's and the connector's spans join the trace (appliance.observability.tracing).

A request records only ids, clock readings and a few of its record's fields as it goes;
another process (appliance.observability.exportproc) writes them as OTLP spans
(appliance.observability.otlpwire, SpanWriter here) and sends them. The proxy's one core is
its whole data path: the SDK's span objects and encoder took half of its rate at
concurrency 64, and writing and sending the spans' bytes in its own loop still a tenth
(bench/proxy_overhead.py --tracing)."""

from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Any

from appliance.observability import otlpwire as wire
from appliance.observability.exportproc import ExportProcess

if TYPE_CHECKING:
    from appliance.proxy.record import Record

_REQUEST = wire.name_kind("pd.request", wire.KIND_SERVER)
_REQUEST_ID, _TRANSFER_ID = wire.Key("pd.request_id"), wire.Key("pd.transfer_id")
_OUTPUT, _PROMPT = wire.Key("pd.output_tokens"), wire.Key("pd.prompt_tokens")
# Attributes with few values (nodes, routes, paths, statuses), written once each.
_CACHE_MAX = 4096
# A request's calls that get spans (their span ids' last hex digit is 1 to 15).
_DIGITS = "0123456789abcdef"
MAX_CALLS = 15
_BYTES = [bytes((i,)) for i in range(256)]  # a call's span id's last byte
_CALL = 5  # a call's fields in RequestTrace's calls: role, node, transfer id, start, end
_monotonic_ns = time.monotonic_ns
_STEM_ZERO = "0" * 15


class _RandomHex:
    """Random hex digits, drawn from os.urandom 4 KiB at a time: formatting a random 128-bit
    number as hex cost 0.5 µs a request, a slice of this a tenth of it."""

    __slots__ = ("_pool", "_at")

    def __init__(self) -> None:
        self._pool, self._at = "", 0

    def take(self, n: int) -> str:
        at = self._at
        end = at + n
        if end > len(self._pool):
            self._pool, at, end = os.urandom(4096).hex(), 0, n
        self._at = end
        return self._pool[at:end]


_hex = _RandomHex().take


class Tracing:
    """The proxy's tracer (made only when an OTLP endpoint is set)."""

    def __init__(self, endpoint: str, protocol: str, sample_ratio: float = 1.0) -> None:
        self.endpoint, self.protocol = endpoint, protocol
        self.export = ExportProcess(endpoint, protocol, f"{__name__}:SpanWriter")
        self.sample_ratio = sample_ratio
        # Paused (PUT /admin/tracing): requests go as if no endpoint were set, no context
        # sent; the exporter stays up, so resuming costs nothing.
        self.enabled = True

    def state(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "protocol": self.protocol, "enabled": self.enabled,
                "sample_ratio": self.sample_ratio, "spans": dict(self.export.counts)}

    async def start(self) -> None:
        await self.export.start()

    async def close(self) -> None:
        await self.export.close()  # what is queued is sent

    def begin(self) -> RequestTrace | Unsampled | None:
        """A request's trace; None while tracing is paused."""
        if not self.enabled:
            return None
        if self.sample_ratio < 1.0 and random.random() >= self.sample_ratio:
            return Unsampled()
        return RequestTrace(self.export)


class SpanWriter:
    """A request's record (RequestTrace.finish; its fields as `encode` unpacks them) as
    OTLP spans: the exporter process's writer. Records cross the pipe as msgpack, so
    tuples arrive as lists; the trace id and the span ids' stem travel as the calls'
    traceparent prefix ("00-<trace id>-<stem>"), clock readings as numbers."""

    resource = {"service.name": "pd-proxy"}
    scope = "appliance.proxy"

    @staticmethod
    def spans(raw: Any) -> int:
        return 1 + len(raw[-1]) // _CALL  # the request's, and one per call

    def __init__(self) -> None:
        # What a span writes the same for many requests, written once: a call's name and
        # node; the request's name, route, status, path and split decision.
        self._fixed: dict[tuple[Any, ...], bytes] = {}

    def _fixed_call(self, role: str, url: str) -> bytes:
        out = self._fixed.get((role, url))
        if out is None:
            out = self._remember((role, url), wire.name_kind(f"pd.{role}", wire.KIND_CLIENT)
                                 + wire.attr("pd.node", url))
        return out

    def _fixed_request(self, route: str, status: int, path: str, where: str | None,
                       reason: str | None) -> bytes:
        key = (route, status, path, where, reason)
        out = self._fixed.get(key)
        if out is None:
            split = b"" if where is None else wire.attr("pd.split", f"{where}:{reason}")
            out = self._remember(key, b"".join((
                _REQUEST, wire.attr("http.route", route), wire.attr("http.status_code", status),
                wire.attr("pd.path", path), split)))
        return out

    def _remember(self, key: tuple[Any, ...], value: bytes) -> bytes:
        if len(self._fixed) >= _CACHE_MAX:
            self._fixed.clear()
        self._fixed[key] = value
        return value

    def encode(self, raw: Any) -> bytes:
        """A request's spans: its own, then one per call, children of it. Unpacked by
        position: this runs for every request traced (13.5 µs of CPU per span in the
        exporter under bench/proxy_overhead.py's load, with a span written field by field).
        Clock readings arrive monotonic (the request's start in seconds, the rest in ns;
        the monotonic clock is the host's, so this process's offset makes them the
        epoch's); span ids arrive as their traceparent's hex (RequestTrace)."""
        (parent, started, end_ns, request_id, route, status, path, transfer_id,
         output, prompt, where, reason, fallback, error, calls) = raw
        wall = time.time_ns() - _monotonic_ns()
        trace_id = bytes.fromhex(parent[3:35])
        span_id = bytes.fromhex(parent[36:] + "0")
        stem, low = span_id[:7], span_id[7]  # a call's span id: its index + 1 in low's digit
        rid = _REQUEST_ID.str(request_id)
        xfer = _TRANSFER_ID.str(transfer_id) if transfer_id else b""
        child_head, framed = wire.child_head, wire.framed
        out = []
        for at in range(0, len(calls), _CALL):
            role, url, call_xfer, call_start, call_end = calls[at:at + _CALL]
            if call_xfer != transfer_id:  # a call made before the transfer was named
                call_xfer = _TRANSFER_ID.str(call_xfer) if call_xfer else b""
            else:
                call_xfer = xfer
            out.append(framed(b"".join((
                child_head(trace_id, stem + _BYTES[low | (at // _CALL + 1)], span_id,
                           call_start + wall, (call_end or end_ns) + wall),
                self._fixed_call(role, url), rid, call_xfer))))
        parts = [wire.root_head(trace_id, span_id, round(started * 1e9) + wall, end_ns + wall),
                 self._fixed_request(route, status, path, where, reason), rid, xfer,
                 _OUTPUT.int(output)]
        if fallback:
            parts.append(wire.attr("pd.fallback", fallback))
        if prompt:
            parts.append(_PROMPT.int(prompt))
        if error is not None:
            parts.append(wire.error_status(error))
        out.append(framed(b"".join(parts)))
        return b"".join(out)


class Unsampled:
    """A request not traced: nothing is recorded, but its calls carry a context whose
    sampled flag is off, so vLLM and the connector record nothing for it either (vLLM
    would start a trace of its own for a request that came without one)."""

    __slots__ = ("_trace",)

    def __init__(self) -> None:
        self._trace = f"00-{_hex(32)}-"

    def call(self, role: str, url: str, rec: Record, headers: dict[str, str]) -> None:
        span = _hex(16)
        if span == "0000000000000000":  # the one span id W3C rules out
            span = "0000000000000001"
        headers["traceparent"] = f"{self._trace}{span}-00"

    def finish(self, rec: Record) -> None:
        pass


class RequestTrace:
    """A sampled request's ids and clock readings, as its calls begin: the least work that
    makes its spans, on the proxy's hot path. Each method call and object here costs the
    proxy's one core several times what a loop timing it alone shows (its caches are cold
    with everything else a request touches), so a request makes one of these, one call per
    upstream call and one at its end; P's call ends when P answered (Record.prefilled_at),
    any call when the next to its node begins or the request ends.

    One random number names it all: the trace id, and a 60-bit stem of the span ids whose
    last hex digit is 0 for the request's own span and the call's index + 1 for a call's
    (unique within the trace, which is all a span id needs; vLLM's spans bring their own).
    The calls' fields lie in one flat list (_CALL each): a list per call cost an object
    more per call."""

    __slots__ = ("_add", "_parent", "_calls")

    def __init__(self, export: ExportProcess) -> None:
        self._add = export.add
        trace = _hex(32)
        if trace[17:] == _STEM_ZERO:  # the request's span id would be all zeros
            trace = trace[:31] + "1"
        self._parent = f"00-{trace}-{trace[17:]}"  # a call's digit, then "-01", follows
        # Role, node, transfer id, start and end (monotonic ns; 0 while it runs) of each.
        self._calls: list[Any] = []

    def call(self, role: str, url: str, rec: Record, headers: dict[str, str]) -> None:
        """A call to a `role` node begins (ending this request's earlier one there): its
        span's context goes in the call's `headers`."""
        calls = self._calls
        now = _monotonic_ns()
        n = len(calls)
        if n:
            for i in range(0, n, _CALL):
                if calls[i] == role and not calls[i + 4]:
                    calls[i + 4] = now
            if n >= MAX_CALLS * _CALL:  # retried past reason: vLLM's span joins the request's
                headers["traceparent"] = f"{self._parent}0-01"
                return
        headers["traceparent"] = f"{self._parent}{_DIGITS[n // _CALL + 1]}-01"
        calls += (role, url, rec.transfer_id, now, 0)

    def finish(self, rec: Record) -> None:
        now = _monotonic_ns()
        calls = self._calls
        answered = rec.prefilled_at
        if answered is not None:
            answered_ns = round(answered * 1e9)
            for i in range(0, len(calls), _CALL):
                if calls[i] == "prefill" and not calls[i + 4] and calls[i + 3] <= answered_ns:
                    calls[i + 4] = answered_ns
        placed = rec.placed
        error = (rec.error or str(rec.status)) if rec.status >= 500 or rec.error else None
        self._add((  # as SpanWriter.encode unpacks it
            self._parent, rec.started, now, rec.request_id, rec.route,
            rec.status, rec.path, rec.transfer_id, rec.usage_output or rec.tokens_out,
            rec.usage_prompt or rec.prompt_tokens or 0,
            None if placed is None else placed.where, None if placed is None else placed.reason,
            rec.fallback, error, calls), 1 + len(calls) // _CALL)
