"""One client request as a trace: the request's span (`pd.request`) and a child for each
call to P or D (`pd.prefill`, `pd.decode`), whose W3C context goes with the call so that
vLLM's and the connector's spans join the trace (appliance.observability.tracing).

A request records only ids, clock readings and a few of its record's fields as it goes;
another process (appliance.observability.exportproc) writes them as OTLP spans
(appliance.proxy.spanwriter) and sends them. The proxy's one core is
its whole data path: the SDK's span objects and encoder took half of its rate at
concurrency 64, and writing and sending the spans' bytes in its own loop still a tenth
(bench/proxy_overhead.py --tracing)."""

from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Any

from appliance.observability.exportproc import ExportProcess

if TYPE_CHECKING:
    from appliance.proxy.access import AccessRecord

# A request's calls that get spans (their span ids' last hex digit is 1 to 15).
_DIGITS = "0123456789abcdef"
MAX_CALLS = 15
# A call's fields in RequestTrace's calls (role, node, transfer id, start, end), as
# appliance.proxy.spanwriter reads them.
CALL_FIELDS = 5
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
        self.export = ExportProcess(endpoint, protocol, "appliance.proxy.spanwriter:SpanWriter")
        self.sample_ratio = sample_ratio
        # Paused (PUT /admin/tracing): nothing is recorded, and each call carries an
        # unsampled context, so P and D (which export to the same collector) record nothing
        # either; the exporter stays up, so resuming costs nothing.
        self.enabled = True

    def state(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "protocol": self.protocol, "enabled": self.enabled,
                "sample_ratio": self.sample_ratio, "spans": dict(self.export.counts)}

    async def start(self) -> None:
        await self.export.start()

    async def close(self) -> None:
        await self.export.close()  # what is queued is sent

    def begin(self) -> RequestTrace | Unsampled:
        """A request's trace: unsampled while tracing is paused, or by the sample ratio."""
        if not self.enabled:
            return Unsampled()
        if self.sample_ratio < 1.0 and random.random() >= self.sample_ratio:
            return Unsampled()
        return RequestTrace(self.export)


class Unsampled:
    """A request not traced: nothing is recorded, but its calls carry a context whose
    sampled flag is off, so vLLM and the connector record nothing for it either (vLLM
    would start a trace of its own for a request that came without one)."""

    __slots__ = ("_trace",)

    def __init__(self) -> None:
        self._trace = f"00-{_hex(32)}-"

    def call(self, role: str, url: str, rec: AccessRecord, headers: dict[str, str]) -> None:
        span = _hex(16)
        if span == "0000000000000000":  # the one span id W3C rules out
            span = "0000000000000001"
        headers["traceparent"] = f"{self._trace}{span}-00"

    def finish(self, rec: AccessRecord) -> None:
        pass


class RequestTrace:
    """A sampled request's ids and clock readings, as its calls begin: the least work that
    makes its spans, on the proxy's hot path. Each method call and object here costs the
    proxy's one core several times what a loop timing it alone shows (its caches are cold
    with everything else a request touches), so a request makes one of these, one call per
    upstream call and one at its end; P's call ends when P answered (the record's
    `prefilled_at`), any call when the next to its node begins or the request ends.

    One random number names it all: the trace id, and a 60-bit stem of the span ids whose
    last hex digit is 0 for the request's own span and the call's index + 1 for a call's
    (unique within the trace, which is all a span id needs; vLLM's spans bring their own).
    The calls' fields lie in one flat list (CALL_FIELDS each): a list per call cost an object
    more per call."""

    __slots__ = ("_add", "_parent", "_calls")

    def __init__(self, export: ExportProcess) -> None:
        self._add = export.add
        trace = _hex(32)
        stem = trace[17:]
        if stem == _STEM_ZERO:  # the request's span id would be all zeros
            trace, stem = trace[:31] + "1", stem[:14] + "1"
        self._parent = f"00-{trace}-{stem}"  # a call's digit, then "-01", follows
        # Role, node, transfer id, start and end (monotonic ns; 0 while it runs) of each.
        self._calls: list[Any] = []

    def call(self, role: str, url: str, rec: AccessRecord, headers: dict[str, str]) -> None:
        """A call to a `role` node begins (ending this request's earlier one there): its
        span's context goes in the call's `headers`."""
        calls = self._calls
        now = _monotonic_ns()
        n = len(calls)
        if n:
            for i in range(0, n, CALL_FIELDS):
                if calls[i] == role and not calls[i + 4]:
                    calls[i + 4] = now
            if n >= MAX_CALLS * CALL_FIELDS:  # retried past reason: vLLM's span joins the request's
                headers["traceparent"] = f"{self._parent}0-01"
                return
        headers["traceparent"] = f"{self._parent}{_DIGITS[n // CALL_FIELDS + 1]}-01"
        calls += (role, url, rec.transfer_id, now, 0)

    def finish(self, rec: AccessRecord) -> None:
        now = _monotonic_ns()
        calls = self._calls
        answered = rec.prefilled_at
        if answered is not None:
            answered_ns = round(answered * 1e9)
            for i in range(0, len(calls), CALL_FIELDS):
                if calls[i] == "prefill" and not calls[i + 4] and calls[i + 3] <= answered_ns:
                    calls[i + 4] = answered_ns
        placed = rec.placed
        error = (rec.error or str(rec.status)) if rec.status >= 500 or rec.error else None
        self._add((  # as appliance.proxy.spanwriter.SpanWriter.encode unpacks it
            self._parent, rec.started, now, rec.request_id, rec.route,
            rec.status, rec.path, rec.transfer_id, rec.usage_output or rec.tokens_out,
            rec.usage_prompt or rec.prompt_tokens or 0,
            None if placed is None else placed.where, None if placed is None else placed.reason,
            rec.fallback, error, calls), 1 + len(calls) // CALL_FIELDS)
