"""The KV transfer inside its request's trace (appliance.observability.tracing): P's write
(`pd.kv_write`) and D's pull (`pd.kv_pull`) as spans, children of the proxy's call to that
node. vLLM hands the scheduler each request's trace headers; the scheduler passes their
`traceparent` to the worker by transfer id (PDConnectorMetadata.trace_parents). Off unless
vLLM runs with an OTLP endpoint (`--otlp-traces-endpoint`, which it passes on to its
engine and worker processes as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

from appliance.observability import tracing

log = logging.getLogger("vllm.appliance.connector.spans")

# Transfers whose parent is remembered: a transfer's span is recorded within seconds of its
# parent arriving, so the oldest are long over.
_KEEP = 4096


def traceparent_of(request: Any) -> str | None:
    """The `traceparent` vLLM received with a request (None: the caller sent none)."""
    headers = getattr(request, "trace_headers", None)
    return headers.get("traceparent") if headers else None


class TransferSpans:
    def __init__(self, role: str, engine_id: str, tp_rank: int) -> None:
        self._tracer = None
        try:
            self._tracer = tracing.tracer_from_env(
                f"pd-connector-{role}", **{"pd.engine_id": engine_id, "pd.tp_rank": str(tp_rank),
                                           "process.pid": str(os.getpid())})
        except Exception:  # noqa: BLE001 - a bad endpoint must not stop the worker
            log.exception("tracing off: its exporter could not be made")
        self._parents: OrderedDict[str, str] = OrderedDict()

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def parents(self, by_transfer: dict[str, str]) -> None:
        if self._tracer is None:
            return
        self._parents.update(by_transfer)
        while len(self._parents) > _KEEP:
            self._parents.popitem(last=False)

    def record(self, name: str, transfer_id: str, started_s: float,
               attributes: dict[str, Any], error: str | None = None) -> None:
        """A span from `started_s` (time.monotonic()) until now, if the transfer's request
        came with a trace context."""
        parent = self._parents.get(transfer_id)
        if parent is None or self._tracer is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span = self._tracer.start_span(
            name, context=tracing.context_of({"traceparent": parent}),
            start_time=tracing.wall_ns(started_s),
            attributes={"pd.transfer_id": transfer_id, **attributes})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
