"""OpenAI-style errors: JSON bodies, SSE error events, and upstream bodies made uniform."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from appliance.httperrors import error_body, json_error


class ProxyError(Exception):
    """Ends a request with an OpenAI-style error; raised anywhere below the handler."""

    def __init__(self, status: int, message: str, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type)


class NodeDown(ProxyError):
    """The node serving a request failed before the client's first byte in a way that says
    it will not answer: unreachable, or found down by its health checks. Another decode node
    may serve the request (appliance.proxy.exchange.paths.Paths.elsewhere)."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(502, message)
        self.url = url


def status_kind(status: int) -> str:
    """An error status as the upstream-error metric's `kind`."""
    return "http_4xx" if status < 500 else "http_5xx"


def sse_error_event(status: int, message: str, err_type: str | None = None) -> bytes:
    """What a stream ends with when D fails after its first byte: an error, never a silent cut."""
    return b"data: " + msgspec.json.encode(error_body(status, message, err_type)) + b"\n\n"


def upstream_error_body(status: int, raw: bytes, who: str) -> dict[str, Any]:
    """vLLM answers `{"error": {...}}` (new) or `{"object": "error", "message": ...}` (old);
    anything else (a load balancer's HTML page) becomes a message naming the node."""
    message, err_type = "", None
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error") if isinstance(data.get("error"), dict) else data
        message = inner.get("message") if isinstance(inner.get("message"), str) else ""
        err_type = inner.get("type") if isinstance(inner.get("type"), str) else None
    if not message:
        text = raw[:200].decode("utf-8", "replace").strip()
        message = f"{who} answered {status}" + (f": {text}" if text else "")
    return error_body(status, message, err_type)


@web.middleware
async def proxy_errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """ProxyError raised outside the generation handler, as OpenAI-style JSON (aiohttp's own
    errors are made JSON by the shared json_errors_middleware behind this one)."""
    try:
        return await handler(request)
    except ProxyError as exc:
        return json_error(exc.status, exc.message, exc.err_type, headers=exc.headers or None)
