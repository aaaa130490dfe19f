"""Spans' bytes (appliance.observability.otlpwire), batched and sent over OTLP from the
event loop that makes them: no thread, no span objects, one POST or gRPC call a batch.

Settings are OpenTelemetry's own variables, read as its SDK reads them: the batch
processor's OTEL_BSP_SCHEDULE_DELAY (ms), OTEL_BSP_MAX_QUEUE_SIZE and
OTEL_BSP_MAX_EXPORT_BATCH_SIZE; the exporter's OTEL_EXPORTER_OTLP_[TRACES_]HEADERS,
_TIMEOUT (seconds) and _COMPRESSION (gzip). A full queue drops new spans, and a batch the
collector refuses or cannot take is dropped after a second try: tracing never holds a
request or grows without bound. Both are counted (`counts`: the proxy's pd_proxy_trace_spans_total).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from appliance.observability import otlpwire

log = logging.getLogger("appliance.observability.otlp")

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_RETRY_AFTER_S = 1.0
_WARN_EVERY_S = 60.0


def _env(env: Mapping[str, str], name: str, default: str = "") -> str:
    """OTEL_EXPORTER_OTLP_TRACES_<name>, else OTEL_EXPORTER_OTLP_<name>."""
    return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(
        f"OTEL_EXPORTER_OTLP_{name}") or default


def _number(env: Mapping[str, str], name: str, default: float, least: float) -> float:
    """A numeric variable; one that is not a number of at least `least` is named in a
    warning and the default taken (as the SDK does), not a proxy that fails to start."""
    text = env.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = least - 1
    if value < least:
        log.warning("%s=%r is not a number of at least %g: %g taken", name, text, least,
                    default)
        return default
    return value


def parse_headers(text: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (values URL-encoded), as OTEL_EXPORTER_OTLP_HEADERS writes them."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip().lower()] = unquote(value.strip())
    return out


class SpanExport:
    """The queue of spans and the task that sends them."""

    def __init__(self, endpoint: str, protocol: str, resource: Mapping[str, str | int],
                 scope: str, env: Mapping[str, str] = os.environ,
                 encode: Callable[[Any], bytes] = bytes) -> None:
        """`encode`: what turns a queued entry into its spans' bytes (entries queued as
        recorded, written a batch at a time); by default entries are the bytes."""
        if protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f"OTLP protocol {protocol!r}: one of grpc, http/protobuf")
        self.endpoint, self.protocol = endpoint, protocol
        self.resource, self.scope = dict(resource), scope
        self.delay_s = _number(env, "OTEL_BSP_SCHEDULE_DELAY", 5000, 1) / 1000
        self.max_queue = int(_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048, 1))
        self.max_batch = int(_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, 1))
        timeout = next((n for n in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                                    "OTEL_EXPORTER_OTLP_TIMEOUT") if env.get(n)), "")
        self.timeout_s = _number(env, timeout, 10, 0.001) if timeout else 10.0
        self.headers = parse_headers(_env(env, "HEADERS"))
        self.gzip = _env(env, "COMPRESSION").lower() == "gzip"
        self.counts = {"exported": 0, "dropped": 0}
        self.encode = encode
        self._entries: list[tuple[Any, int]] = []  # one request's spans, and how many
        self._queued = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._send: Any = None  # async (body) -> None; raises on failure
        self._close: Any = None
        self._closing = False
        self._warned = -_WARN_EVERY_S

    def add(self, spans: Any, n: int) -> None:
        """`n` spans, sent with the next batch: their bytes (otlpwire.span()s joined), or
        what `encode` writes them from."""
        if self._queued + n > self.max_queue:
            self.counts["dropped"] += n
            return
        self._entries.append((spans, n))
        self._queued += n
        if self._queued >= self.max_batch and self._wake is not None:
            self._wake.set()

    def start(self) -> None:
        """In the running loop: the transport, and the task that sends."""
        if self.protocol == "grpc":
            self._send, self._close = _grpc(self.endpoint, self.headers, self.gzip,
                                            self.timeout_s)
        else:
            self._send, self._close = _http(self.endpoint, self.headers, self.gzip,
                                            self.timeout_s)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="otlp-export")

    async def _run(self) -> None:
        """Sends until closed, then sends the rest. It stops at a flag, not by being
        cancelled: Python 3.11's wait_for loses a cancel that meets its wait's end (the
        sender then ran on and its process never exited), and a cancelled send lost its
        batch uncounted."""
        assert self._wake is not None
        while not self._closing:
            try:  # a full batch wakes it, or close; else the schedule sends what there is
                await asyncio.wait_for(self._wake.wait(), self.delay_s)
                full_only = not self._closing
            except asyncio.TimeoutError:
                full_only = False
            self._wake.clear()
            await self.flush(full_only)
        await self.flush()

    async def flush(self, full_only: bool = False) -> None:
        """Send what is queued, a batch at a time (`full_only`: whole batches only, so that
        what comes in while one is sent waits to fill the next)."""
        while self._entries and (not full_only or self._queued >= self.max_batch):
            take = n = 0
            while take < len(self._entries) and (n == 0 or n + self._entries[take][1]
                                                 <= self.max_batch):
                n += self._entries[take][1]
                take += 1
            batch, self._entries = self._entries[:take], self._entries[take:]
            self._queued -= n
            body = otlpwire.request(self.resource, self.scope,
                                    [self.encode(raw) for raw, _ in batch])
            try:
                sent = await self._deliver(body)
            except asyncio.CancelledError:
                self.counts["dropped"] += n
                raise
            self.counts["exported" if sent else "dropped"] += n

    async def _deliver(self, body: bytes) -> bool:
        """One batch to the collector, tried twice (a collector restarting, a 503)."""
        why = ""
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(_RETRY_AFTER_S)
            try:
                await self._send(body)
                return True
            except Exception as exc:  # noqa: BLE001 - a collector's failure is logged, not raised
                why = str(exc) or repr(exc)
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning("OTLP export to %s failed (%s): spans dropped", self.endpoint, why)
        return False

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (waiting at most `timeout_s`; what is left then is counted
        dropped), and stop."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None and self._wake is not None:
            self._wake.set()
            await asyncio.wait({task}, timeout=timeout_s)
            if not task.done():  # a send that hangs: its batch is counted as it ends
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
        self.counts["dropped"] += self._queued
        self._entries, self._queued = [], 0
        if self._send is not None:
            await self._close()
            self._send = None


def _http(endpoint: str, headers: dict[str, str], compress: bool, timeout_s: float) -> Any:
    import aiohttp

    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
    sent = {"Content-Type": "application/x-protobuf", **headers}
    if compress:
        sent["Content-Encoding"] = "gzip"

    async def send(body: bytes) -> None:
        data = gzip.compress(body, 1) if compress else body
        async with session.post(endpoint, data=data, headers=sent) as resp:
            await resp.read()
            if resp.status >= 300:
                raise RuntimeError(f"HTTP {resp.status}")

    return send, session.close


def _grpc(endpoint: str, headers: dict[str, str], compress: bool, timeout_s: float) -> Any:
    import grpc

    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    target = parts.netloc or parts.path
    channel = (grpc.aio.secure_channel(target, grpc.ssl_channel_credentials())
               if parts.scheme == "https" else grpc.aio.insecure_channel(target))
    # No serializers: the request is otlpwire's bytes, the answer is not read.
    export = channel.unary_unary(GRPC_METHOD)
    metadata = tuple(headers.items())
    compression = grpc.Compression.Gzip if compress else None

    async def send(body: bytes) -> None:
        try:
            await export(body, timeout=timeout_s, metadata=metadata, compression=compression)
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"gRPC {exc.code().name}: {exc.details()}") from exc

    return send, channel.close
