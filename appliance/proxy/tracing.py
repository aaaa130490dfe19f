"""One client request as a trace: the request's span (`pd.request`) and a child for each
call to P or D (`pd.prefill`, `pd.decode`), whose W3C context goes with the call so that
vLLM's and the connector's spans join the trace (appliance.observability.tracing).

The spans are written as OTLP bytes when they end (appliance.observability.otlpwire) and
sent in batches from the proxy's loop (otlpexport), not made as SDK span objects: the
proxy's one core is its whole data path, and the SDK's spans and encoder took half of its
rate at concurrency 64 (bench/proxy_overhead.py --tracing)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from appliance.observability import otlpwire as wire
from appliance.observability.otlpexport import SpanExport
from appliance.observability.tracing import wall_ns

if TYPE_CHECKING:
    from appliance.proxy.record import Record

_REQUEST = wire.name_kind("pd.request", wire.KIND_SERVER)
_REQUEST_ID, _TRANSFER_ID = wire.Key("pd.request_id"), wire.Key("pd.transfer_id")
_OUTPUT, _PROMPT = wire.Key("pd.output_tokens"), wire.Key("pd.prompt_tokens")
# Attributes with few values (nodes, routes, paths, statuses), written once each.
_CACHE_MAX = 4096


class Tracing:
    """The proxy's tracer (made only when an OTLP endpoint is set)."""

    def __init__(self, endpoint: str, protocol: str, sample_ratio: float = 1.0) -> None:
        self.export = SpanExport(endpoint, protocol, {"service.name": "pd-proxy"},
                                 "appliance.proxy")
        self.sample_ratio = sample_ratio
        self._names: dict[str, bytes] = {}
        self._attrs: dict[tuple[str, str | int], bytes] = {}

    def start(self) -> None:
        self.export.start()

    async def close(self) -> None:
        await self.export.close()  # sends what is queued

    def begin(self, rec: Record) -> RequestTrace | Unsampled:
        if self.sample_ratio < 1.0 and random.random() >= self.sample_ratio:
            return Unsampled()
        return RequestTrace(self, rec)

    def name(self, role: str) -> bytes:
        named = self._names.get(role)
        if named is None:
            named = self._names[role] = wire.name_kind(f"pd.{role}", wire.KIND_CLIENT)
        return named

    def attr(self, key: str, value: str | int) -> bytes:
        """An attribute of few values, written once."""
        out = self._attrs.get((key, value))
        if out is None:
            if len(self._attrs) >= _CACHE_MAX:
                self._attrs.clear()
            out = self._attrs[(key, value)] = wire.attr(key, value)
        return out


class Unsampled:
    """A request not traced: nothing is recorded, but its calls carry a context whose
    sampled flag is off, so vLLM and the connector record nothing for it either (vLLM
    would start a trace of its own for a request that came without one)."""

    def __init__(self) -> None:
        self._trace = f"00-{random.getrandbits(128):032x}-"

    def call(self, role: str, url: str, rec: Record) -> dict[str, str]:
        return {"traceparent": f"{self._trace}{random.getrandbits(64) or 1:016x}-00"}

    def end(self, role: str) -> None:
        pass

    def finish(self, rec: Record) -> None:
        pass


class RequestTrace:
    __slots__ = ("_tracing", "_trace_id", "_span_id", "_start_ns", "_traceparent", "_rid",
                 "_xfer", "_calls", "_done")

    def __init__(self, tracing: Tracing, rec: Record) -> None:
        self._tracing = tracing
        self._trace_id = (random.getrandbits(128) or 1).to_bytes(16, "big")
        self._span_id = (random.getrandbits(64) or 1).to_bytes(8, "big")
        # Started where the record was: the client's request has been read by then.
        self._start_ns = wall_ns(rec.started)
        self._traceparent = f"00-{self._trace_id.hex()}-"  # a call's span id follows
        self._rid = _REQUEST_ID.str(rec.request_id)
        self._xfer = ("", b"")  # the transfer id, and its attribute
        self._calls: dict[str, tuple[bytes, int, bytes]] = {}  # role: span id, start, attrs
        self._done: list[bytes] = []

    def call(self, role: str, url: str, rec: Record) -> dict[str, str]:
        """A call to a `role` node begins (ending this request's earlier one there): the
        headers that carry its span's context."""
        self.end(role)
        span_id = (random.getrandbits(64) or 1).to_bytes(8, "big")
        t = self._tracing
        attrs = b"".join((t.attr("pd.node", url), self._rid, self._transfer(rec)))
        self._calls[role] = (span_id, time.time_ns(), attrs)
        return {"traceparent": f"{self._traceparent}{span_id.hex()}-01"}

    def _transfer(self, rec: Record) -> bytes:
        if self._xfer[0] != rec.transfer_id:
            self._xfer = (rec.transfer_id, _TRANSFER_ID.str(rec.transfer_id))
        return self._xfer[1]

    def end(self, role: str) -> None:
        call = self._calls.pop(role, None)
        if call is not None:
            span_id, start, attrs = call
            self._done.append(wire.span(self._trace_id, span_id, self._span_id,
                                        self._tracing.name(role), start, time.time_ns(), attrs))

    def finish(self, rec: Record) -> None:
        for role in list(self._calls):
            self.end(role)
        t = self._tracing
        attrs = [t.attr("http.route", rec.route), self._rid,
                 t.attr("http.status_code", rec.status), t.attr("pd.path", rec.path),
                 self._transfer(rec), _OUTPUT.int(rec.usage_output or rec.tokens_out)]
        if rec.placed is not None:
            attrs.append(t.attr("pd.split", f"{rec.placed.where}:{rec.placed.reason}"))
        if rec.fallback:
            attrs.append(wire.attr("pd.fallback", rec.fallback))
        if rec.usage_prompt or rec.prompt_tokens:
            attrs.append(_PROMPT.int(rec.usage_prompt or rec.prompt_tokens or 0))
        error = (rec.error or str(rec.status)) if rec.status >= 500 or rec.error else None
        self._done.append(wire.span(self._trace_id, self._span_id, None, _REQUEST,
                                    self._start_ns, time.time_ns(), b"".join(attrs), error))
        t.export.add(b"".join(self._done), len(self._done))
