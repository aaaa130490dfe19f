"""One client request as a trace (appliance.observability.tracing): the request's span and
a child for each call to P or D, whose trace context goes with the call."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from appliance.observability import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from appliance.proxy.record import Record


class Tracing:
    """The proxy's tracer (made only when an OTLP endpoint is set)."""

    def __init__(self, endpoint: str, protocol: str, sample_ratio: float = 1.0) -> None:
        self.provider: TracerProvider = tracing.provider("pd-proxy", endpoint, protocol,
                                                         root=True)
        self.tracer: Tracer = self.provider.get_tracer("appliance.proxy")
        self.sample_ratio = sample_ratio

    def begin(self, rec: Record) -> RequestTrace | Unsampled:
        if self.sample_ratio < 1.0 and random.random() >= self.sample_ratio:
            return Unsampled()
        return RequestTrace(self.tracer, rec)

    def close(self) -> None:
        self.provider.shutdown()  # exports what is buffered


class Unsampled:
    """A request not traced: no span is made (the SDK's unsampled spans cost a third of a
    sampled one's), but its calls carry a context whose sampled flag is off, so vLLM and
    the connector record nothing for it either (vLLM would start a trace of its own for a
    request that came without one)."""

    def __init__(self) -> None:
        self._trace = f"00-{random.getrandbits(128):032x}-"

    def call(self, role: str, url: str, rec: Record) -> dict[str, str]:
        return {"traceparent": f"{self._trace}{random.getrandbits(64) or 1:016x}-00"}

    def end(self, role: str) -> None:
        pass

    def finish(self, rec: Record) -> None:
        pass


class RequestTrace:
    def __init__(self, tracer: Tracer, rec: Record) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self._tracer = tracer
        self._kind = SpanKind.CLIENT
        # Started where the record was: the client's request has been read by then.
        self.root = tracer.start_span(
            "pd.request", kind=SpanKind.SERVER, start_time=tracing.wall_ns(rec.started),
            attributes={"http.route": rec.route, "pd.request_id": rec.request_id})
        self._parent = trace.set_span_in_context(self.root)
        self._calls: dict[str, Span] = {}

    def call(self, role: str, url: str, rec: Record) -> dict[str, str]:
        """A call to a `role` node begins (ending this request's earlier one there): the
        headers that carry its span's context."""
        self.end(role)
        span = self._tracer.start_span(
            f"pd.{role}", context=self._parent, kind=self._kind,
            attributes={"pd.node": url, "pd.request_id": rec.request_id,
                        "pd.transfer_id": rec.transfer_id})
        self._calls[role] = span
        return tracing.headers_of(span)

    def end(self, role: str) -> None:
        span = self._calls.pop(role, None)
        if span is not None:
            span.end()

    def finish(self, rec: Record) -> None:
        from opentelemetry.trace import Status, StatusCode

        for role in list(self._calls):
            self.end(role)
        attrs: dict[str, str | int] = {"http.status_code": rec.status, "pd.path": rec.path,
                                       "pd.transfer_id": rec.transfer_id,
                                       "pd.output_tokens": rec.usage_output or rec.tokens_out}
        if rec.placed is not None:
            attrs["pd.split"] = f"{rec.placed.where}:{rec.placed.reason}"
        if rec.fallback:
            attrs["pd.fallback"] = rec.fallback
        if rec.usage_prompt or rec.prompt_tokens:
            attrs["pd.prompt_tokens"] = rec.usage_prompt or rec.prompt_tokens or 0
        self.root.set_attributes(attrs)
        if rec.status >= 500 or rec.error:
            self.root.set_status(Status(StatusCode.ERROR, rec.error or str(rec.status)))
        self.root.end()
