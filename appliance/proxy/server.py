"""The proxy as an aiohttp application: its routes and middlewares, the ops endpoints
(/health, /ready, /status, /metrics), and `serve()` for tests and benchmarks. Each
generation request goes to `appliance.proxy.app.Proxy`, its exchange to
`appliance.proxy.exchange`; /tokenize, /detokenize, /version and /v1/models to a D as they
are (`appliance.proxy.passthrough`)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from appliance.httperrors import MAX_BODY_BYTES, error_body, json_error, json_errors_middleware
from appliance.proxy import admin, passthrough
from appliance.proxy.app import COMPLETIONS_ROUTES, Proxy
from appliance.proxy.entry import Entry
from appliance.proxy.errors import proxy_errors_middleware
from appliance.proxy.intake import body_middleware
from appliance.proxy.settings import ProxySettings

_encode = msgspec.json.encode
PROXY = web.AppKey("proxy", Proxy)


def ops_routes(proxy: Proxy) -> list[web.RouteDef]:
    async def health(request: web.Request) -> web.Response:
        reason = proxy.backends.not_ready_reason()
        body = {
            "status": "ok" if reason is None else "unavailable",
            "reason": reason,
            "prefill_ready": len(proxy.backends.ready_prefill()),
            "decode_ready": len(proxy.backends.ready_decode()),
        }
        return web.Response(status=200 if reason is None else 503, body=_encode(body),
                            content_type="application/json")

    async def ready(request: web.Request) -> web.Response:
        """Whether this proxy can answer a request now (a Kubernetes readiness probe):
        unlike /health, a P outage is no reason while requests fall back to D alone."""
        why = proxy.cannot_answer()
        if why is not None:
            body = error_body(503, why)
            body.update(status="unavailable", reason=why)
            return web.Response(status=503, body=_encode(body),
                                content_type="application/json")
        return web.Response(body=_encode({"status": "ok", "reason": None}),
                            content_type="application/json")

    async def status(request: web.Request) -> web.Response:
        body = proxy.backends.status()
        body.update(policy=proxy.settings.policy,
                    fallback_to_decode=proxy.settings.fallback_to_decode,
                    in_flight=proxy.in_flight, split=proxy.placement.describe(),
                    prefix=None if proxy.prefix is None else proxy.prefix.describe())
        return web.Response(body=_encode(body), content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=proxy.metrics.render(),
                            headers={"Content-Type": proxy.metrics.content_type})

    return [web.get("/health", health),
            web.get("/ready", ready), web.get("/status", status), web.get("/metrics", metrics)]


def _auth_middleware(proxy: Proxy) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if proxy.needs_auth(request.path) and not proxy.authorized(request):
            return json_error(401, "missing or invalid API key (Authorization: Bearer ...)",
                              headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return auth


def build_app(settings: ProxySettings) -> web.Application:
    """The proxy as an aiohttp app; run it with handler_cancellation=True (see serve())."""
    proxy = Proxy(settings)
    entry = Entry(proxy)
    middlewares = [json_errors_middleware, proxy_errors_middleware]
    if settings.api_keys:
        middlewares.append(_auth_middleware(proxy))
    middlewares.append(body_middleware(settings.body_timeout_s, settings.max_body_bytes,
                                       proxy.metrics))
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[MAX_BODY_BYTES] = settings.max_body_bytes
    app[PROXY] = proxy
    app.on_startup.append(proxy.start)
    app.on_shutdown.append(lambda _app: admin.drain_on_shutdown(proxy))
    app.on_cleanup.append(proxy.stop)
    app.router.add_routes(admin.routes(proxy))
    for route in COMPLETIONS_ROUTES:
        app.router.add_post(route, entry.handler(route))
    app.router.add_routes(ops_routes(proxy))
    app.router.add_routes(passthrough.routes(proxy))
    return app


class RunningProxy:
    """A proxy serving on a socket: for tests and `pdctl up --local`."""

    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self.runner = runner
        self.url = url

    @property
    def proxy(self) -> Proxy:
        return self.runner.app[PROXY]

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve(settings: ProxySettings) -> RunningProxy:
    """Start the proxy on settings.host:settings.port (0: any free port)."""
    runner = web.AppRunner(build_app(settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    tls = settings.listener_ssl()
    site = web.TCPSite(runner, settings.host, settings.port, ssl_context=tls)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    host, port = sock.getsockname()[:2]
    host = "127.0.0.1" if host == "0.0.0.0" else host
    return RunningProxy(runner, f"{'https' if tls else 'http'}://{host}:{port}")
