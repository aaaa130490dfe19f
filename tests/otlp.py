"""Real OTLP trace receivers for tests, on 127.0.0.1, each in threads of its own so any test
or fixture scope can use it: OTLP/HTTP (POST /v1/traces) and OTLP/gRPC (TraceService's
Export), both decoding ExportTraceServiceRequest with opentelemetry-proto."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(hash=False)
    error: bool = False

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _Receiver:
    """What a receiver got: the spans, and each export's headers (lower-case names)."""

    url: str

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.exports: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def _add(self, req: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        s.name, str(res.get("service.name", "")), s.trace_id.hex(),
                        s.span_id.hex(), s.parent_span_id.hex(), s.start_time_unix_nano,
                        s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes},
                        s.status.code == 2))
        with self._lock:
            self.spans.extend(got)
            self.exports.append(headers)

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, trace_id: str, names: set[str] | dict[str, int],
             timeout: float = 30) -> list[Span]:
        """The trace's spans once every name in `names` is among them (a dict: at least
        that many spans of each name; each process exports on its own schedule)."""
        deadline = time.monotonic() + timeout
        while (spans := self._complete(trace_id, names, deadline)) is None:
            time.sleep(0.1)
        return spans

    async def wait_async(self, trace_id: str, names: set[str] | dict[str, int],
                         timeout: float = 30) -> list[Span]:
        """wait(), for a test whose loop is the exporter's (an in-process proxy)."""
        deadline = time.monotonic() + timeout
        while (spans := self._complete(trace_id, names, deadline)) is None:
            await asyncio.sleep(0.05)
        return spans

    def _complete(self, trace_id: str, names: set[str] | dict[str, int],
                  deadline: float) -> list[Span] | None:
        want = dict.fromkeys(names, 1) if isinstance(names, set) else names
        spans = self.trace(trace_id)
        if all(sum(s.name == n for s in spans) >= k for n, k in want.items()):
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"trace {trace_id}: {sorted(s.name for s in spans)}, "
                                 f"wanted {sorted(names)}")
        return None


class Collector(_Receiver):
    """OTLP/HTTP."""

    def __init__(self) -> None:
        super().__init__()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                outer._add(ExportTraceServiceRequest.FromString(raw),
                           {k.lower(): v for k, v in self.headers.items()})
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcCollector(_Receiver):
    """OTLP/gRPC: the TraceService's Export method, as a collector serves it."""

    def __init__(self) -> None:
        super().__init__()
        import grpc

        def export(req: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
            self._add(req, {k.lower(): v for k, v in context.invocation_metadata()})
            return ExportTraceServiceResponse()

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(
                export, request_deserializer=ExportTraceServiceRequest.FromString,
                response_serializer=ExportTraceServiceResponse.SerializeToString)})
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> GrpcCollector:
        self._server.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.stop(grace=None)


def trace_id_of(traceparent: str) -> str:
    return traceparent.split("-")[1]


def span_id_of(traceparent: str) -> str:
    return traceparent.split("-")[2]
