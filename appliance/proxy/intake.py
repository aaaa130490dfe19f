"""Every request's body, received before its handler runs, within body_timeout_s and
max_body_bytes.

A client that announces a body and stalls (Content-Length 100, 8 bytes sent) would hold
its connection and its handler for as long as it likes: here it gets a 408 at the deadline
and its connection is closed. A handler's own `request.read()` then returns the body at
once (aiohttp keeps it). The bodies being received and those cut are on /metrics.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from appliance.httperrors import json_error
from appliance.proxy.errors import ProxyError
from appliance.proxy.metrics import ProxyMetrics


def body_middleware(timeout_s: float, limit: int, metrics: ProxyMetrics) -> Any:
    """Innermost: an unknown route, a wrong method and a request without the client's key
    are answered before any of its body is read."""
    too_large = f"request body too large (limit {limit} bytes)"

    @web.middleware
    async def receive(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.body_exists or request.match_info.http_exception is not None:
            return await handler(request)
        if request.content_length is not None and request.content_length > limit:
            raise ProxyError(413, too_large)
        # Most bodies come whole with their head: nothing to wait for, nothing to count.
        waits = int(not request.content.is_eof())
        metrics.bodies_receiving += waits
        try:
            read = request.read()
            await (asyncio.wait_for(read, timeout_s) if waits else read)
        except web.HTTPRequestEntityTooLarge:  # no length announced (chunked)
            raise ProxyError(413, too_large) from None
        except asyncio.TimeoutError:
            metrics.body_timeouts += 1
            return await _cut(request, timeout_s)
        finally:
            metrics.bodies_receiving -= waits
        return await handler(request)

    return receive


async def _cut(request: web.Request, timeout_s: float) -> web.StreamResponse:
    """A 408, then the connection closed at once: aiohttp would otherwise linger over the
    rest of the body (10 s) before it gives the connection up."""
    resp = json_error(408, f"request body not received within {timeout_s:g} s "
                           f"(body_timeout_s)")
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp
