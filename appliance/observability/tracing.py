"""OpenTelemetry traces, off unless an OTLP endpoint is set.

One trace per client request: the proxy's span (`pd.request`) with a child for each call to
P or D (`pd.prefill`, `pd.decode`); the W3C `traceparent` of that call goes with it, so
vLLM's own `llm_request` span (its `--otlp-traces-endpoint`) and the connector's transfer
spans (`pd.kv_write` on P, `pd.kv_pull` on D: vLLM hands the scheduler the request's trace
headers) are children of the call that caused them. Every process exports by itself: the proxy
writes its spans' OTLP bytes itself (appliance.proxy.tracing: three spans per request on
its one busy core), the connector through the SDK's batch processor (a few per transfer).
The endpoint and protocol are OpenTelemetry's own variables, which vLLM sets for its
engine and worker processes too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
# vLLM's default, so one endpoint serves the node's every process.
DEFAULT_PROTOCOL: Protocol = "grpc"


def provider(service: str, endpoint: str, protocol: str = DEFAULT_PROTOCOL,
             **resource: str) -> TracerProvider:
    """A tracer provider exporting to `endpoint` in batches (not set as the process's
    global one: vLLM sets its own in its processes). It records what its parent says
    was sampled: the proxy decides for the whole trace (appliance.proxy.tracing)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import DEFAULT_ON

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=endpoint,
                                    insecure=not endpoint.startswith("https://"))
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )
        exporter = HttpExporter(endpoint=endpoint)
    else:
        raise ValueError(f"OTLP protocol {protocol!r}: one of {', '.join(PROTOCOLS)}")
    out = TracerProvider(resource=Resource.create({"service.name": service, **resource}),
                         sampler=DEFAULT_ON)
    out.add_span_processor(BatchSpanProcessor(exporter))
    return out


def tracer_from_env(service: str, **resource: str) -> Tracer | None:
    """The tracer of a process that vLLM started with an OTLP endpoint; None without one."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    protocol = os.environ.get(PROTOCOL_ENV, DEFAULT_PROTOCOL)
    return provider(service, endpoint, protocol, **resource).get_tracer("appliance")


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the epoch nanoseconds a span's start wants."""
    return time.time_ns() - round((time.monotonic() - monotonic_s) * 1e9)


def context_of(headers: Mapping[str, str] | None) -> Context | None:
    """The parent that a request's trace headers name (None: none)."""
    if not headers or "traceparent" not in headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(headers))
