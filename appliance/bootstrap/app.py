"""The bootstrap sidecar: engine id -> workers' side-channel addresses (docs/protocol.md
steps 2, 4, 7, 20).

Wire-compatible with vLLM's MooncakeConnector bootstrap, so vLLM's example proxy and ours
both read it; adds TTL expiry, DELETE for clean shutdown, an optional shared token and
strict body validation (a bad request never changes the registry).

With a token (pdctl always sets one; `python -m appliance.bootstrap` refuses to start without
one unless told `--no-token`), /register, DELETE and /query all need it: /query names the
side channels P's KV is served from, and a registration is where the proxy routes.
"""

from __future__ import annotations

import logging

from aiohttp import web

from appliance import bearer
from appliance.bootstrap.registry import Registry, RegistryConflict
from appliance.bootstrap.settings import BootstrapSettings
from appliance.bootstrap.wire import decode_registration
from appliance.httperrors import MAX_BODY_BYTES, json_error, json_errors_middleware

log = logging.getLogger("appliance.bootstrap")

REGISTRY = web.AppKey("registry", Registry)
KEYS = web.AppKey("keys", bearer.Keys)  # the token; none: every caller


def _authorized(request: web.Request) -> bool:
    keys = request.app[KEYS]
    return not keys or keys.admit(request.headers.get("Authorization", ""))


async def register(request: web.Request) -> web.Response:
    if not _authorized(request):
        return json_error(401, "missing or wrong bootstrap token")
    body = await request.read()
    try:
        reg = decode_registration(body)
        is_new = request.app[REGISTRY].register(reg)
    except ValueError as exc:
        return json_error(400, str(exc))
    except RegistryConflict as exc:
        log.warning("register rejected: %s", exc)
        return json_error(400, str(exc), "conflict_error")
    if is_new:
        log.info(
            "registered engine %s dp %d tp %d pp %d at %s",
            reg.engine_id, reg.dp_rank, reg.tp_rank, reg.pp_rank, reg.addr,
        )
    return web.json_response({"status": "ok"})


async def query(request: web.Request) -> web.Response:
    if not _authorized(request):
        return json_error(401, "missing or wrong bootstrap token")
    answer = request.app[REGISTRY].query()
    return web.json_response(
        {dp: {"engine_id": e.engine_id, "worker_addr": e.worker_addr,
              **({"tp_size": e.tp_size} if e.tp_size else {})} for dp, e in answer.items()}
    )


async def delete_engine(request: web.Request) -> web.Response:
    if not _authorized(request):
        return json_error(401, "missing or wrong bootstrap token")
    engine_id = request.match_info["engine_id"]
    removed = request.app[REGISTRY].delete(engine_id)
    if not removed:
        return json_error(404, f"engine {engine_id!r} is not registered")
    log.info("deleted engine %s (%d dp ranks)", engine_id, removed)
    return web.json_response({"status": "ok", "removed": removed})


async def health(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    registry.expire()
    return web.json_response({"status": "ok", "engines": len(registry)})


def build_app(settings: BootstrapSettings) -> web.Application:
    app = web.Application(
        middlewares=[json_errors_middleware], client_max_size=settings.max_body_bytes
    )
    app[MAX_BODY_BYTES] = settings.max_body_bytes
    app[KEYS] = bearer.Keys([settings.token])
    app[REGISTRY] = Registry(ttl=settings.ttl)
    app.router.add_post("/register", register)
    app.router.add_get("/query", query)
    app.router.add_delete("/engines/{engine_id}", delete_engine)
    app.router.add_get("/health", health)
    return app
