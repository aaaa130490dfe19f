"""Draining: a node taken out of rotation on purpose, and the proxy's own shutdown.

`POST /admin/drain {"node": URL | "prefill" | "decode"}` takes nodes out of rotation (they
get nothing new; what they have finishes, or after `handover_after_s`, default
`drain_handover_s` (0: never), goes on from other engines: nodes/handover.py), `POST
/admin/undrain` puts them back, `GET
/admin/drain` says what is draining and what it still holds (`pdctl drain` drives these).
`PUT /admin/tracing {"sample_ratio": R, "enabled": B}` turns tracing up, down, off and on
again without a restart, where an OTLP endpoint is set (`GET` says how it stands; `pdctl
tracing`). The admin API needs the node's key (the proxy's backend_api_key,
keys/api-key); without one configured, only callers on this host.

SIGTERM (`pdctl down`, `docker compose down`, systemd) drains the proxy itself: the listener
closes, requests in flight get up to `drain_grace_s` to finish, and what is left then ends
with a terminal error (an SSE error event or a 502 JSON body), never a silent cut; P's KV
for them is released as on any failure.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from aiohttp import web

from appliance.httperrors import json_error
from appliance.proxy.errors import ProxyError
from appliance.proxy.jsonbody import decode_object

if TYPE_CHECKING:
    from appliance.proxy.app import Proxy

log = logging.getLogger("appliance.proxy.admin")


def _allowed(proxy: Proxy, request: web.Request) -> bool:
    if proxy.node_key:
        return proxy.node_key.admit(request.headers.get("Authorization", ""))
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


def _refused(proxy: Proxy, request: web.Request) -> web.Response | None:
    """401 for a caller without the node's key; None for one with it."""
    if _allowed(proxy, request):
        return None
    return json_error(401, "the admin API needs the node's key (keys/api-key)",
                      headers={"WWW-Authenticate": "Bearer"})


def _nodes(proxy: Proxy) -> list[dict[str, Any]]:
    return [{"role": b.role, "url": b.url, "draining": b.draining, "in_flight": b.in_flight}
            for b in proxy.backends.all()]


class TracingChange(msgspec.Struct, forbid_unknown_fields=True):
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    enabled: bool | None = None


def tracing_routes(proxy: Proxy) -> list[web.RouteDef]:
    def refused(request: web.Request) -> web.Response | None:
        if (answer := _refused(proxy, request)) is not None:
            return answer
        if proxy.tracing is None:
            return json_error(409, "tracing is off: no OTLP endpoint is set (the host "
                                   "config's [tracing] otlp_endpoint, the proxy's "
                                   "--otlp-traces-endpoint)")
        return None

    async def show(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        assert proxy.tracing is not None
        return web.json_response(proxy.tracing.state())

    async def change(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        tracing = proxy.tracing
        assert tracing is not None
        try:
            body = msgspec.json.decode(await request.read(), type=TracingChange)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return json_error(400, f'expected {{"sample_ratio": 0 to 1, "enabled": true | '
                                   f'false}}: {exc}')
        was = tracing.enabled, tracing.sample_ratio
        if body.sample_ratio is not None:
            tracing.sample_ratio = body.sample_ratio
        if body.enabled is not None:
            tracing.enabled = body.enabled
        log.warning("tracing changed through the admin API: enabled %s -> %s, sample ratio "
                    "%g -> %g", was[0], tracing.enabled, was[1], tracing.sample_ratio)
        return web.json_response(tracing.state())

    return [web.get("/admin/tracing", show), web.put("/admin/tracing", change)]


def routes(proxy: Proxy) -> list[web.RouteDef]:
    async def change(request: web.Request, draining: bool) -> web.Response:
        if (answer := _refused(proxy, request)) is not None:
            return answer
        try:
            body = decode_object(await request.read())
        except ProxyError:
            body = {}
        node, after = body.get("node"), body.get("handover_after_s")
        if not isinstance(node, str) or (after is not None and (
                isinstance(after, bool) or not isinstance(after, (int, float)) or after < 0)):
            return json_error(400, 'expected {"node": URL | "prefill" | "decode"} and, to '
                                   'drain, optionally "handover_after_s": seconds >= 0 '
                                   '(0: never)')
        found = proxy.backends.find(node)
        if not found:
            return json_error(404, f"no node {node!r} (known: "
                                   f"{', '.join(b.url for b in proxy.backends.all())})")
        for b in found:
            proxy.backends.set_draining(b, draining)
            proxy.handover.drained(b.url, after if draining else None)
        return web.json_response({"nodes": _nodes(proxy), "changed": [b.url for b in found]})

    async def drain(request: web.Request) -> web.Response:
        return await change(request, True)

    async def undrain(request: web.Request) -> web.Response:
        return await change(request, False)

    async def show(request: web.Request) -> web.Response:
        if (answer := _refused(proxy, request)) is not None:
            return answer
        return web.json_response({"nodes": _nodes(proxy), "in_flight": proxy.in_flight})

    return [web.post("/admin/drain", drain), web.post("/admin/undrain", undrain),
            web.get("/admin/drain", show), *tracing_routes(proxy)]


async def drain_on_shutdown(proxy: Proxy) -> None:
    """aiohttp's on_shutdown (the listener is closed already): wait for what is in flight,
    up to drain_grace_s, then end the rest with an error."""
    proxy.shutting_down = True
    loop = asyncio.get_running_loop()
    grace = proxy.settings.drain_grace_s
    deadline = loop.time() + grace
    if proxy.in_flight:
        log.warning("shutting down: %d requests in flight get up to %g s to finish",
                    proxy.in_flight, grace)
    while proxy.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if proxy.in_flight:
        failed = proxy.upstreams.fail_all("the proxy is shutting down")
        log.warning("shutting down: %d requests still in flight after %g s end with an "
                    "error (%d upstream calls cut)", proxy.in_flight, grace, failed)
        end = loop.time() + 2.0
        while proxy.in_flight and loop.time() < end:
            await asyncio.sleep(0.05)
