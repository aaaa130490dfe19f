"""vLLM's routes that need no split, answered by a decode node in rotation as it answers
them: `POST /tokenize`, `POST /detokenize`, `GET /version` and `GET /v1/models`. A D serves
the model and tokenizer P does (a node serves one model) and must be up for any request
anyway. README's proxy section lists vLLM's other routes and why the proxy leaves them out.

The client's key is asked where vLLM asks its own (the /v1/ routes, the auth middleware);
the node's key goes upstream. Errors are OpenAI-style JSON; every answer carries the
request's X-Request-Id, which D gets too.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from appliance.httperrors import json_error
from appliance.proxy.access import client_request_id
from appliance.proxy.app import Proxy
from appliance.proxy.errors import ProxyError, upstream_error_body
from appliance.proxy.exchange.bodies import uuid4_str
from appliance.proxy.jsonbody import decode_object
from appliance.proxy.nodes.backends import Backend

POSTS = ("/tokenize", "/detokenize")
GETS = ("/version", "/v1/models")


def routes(proxy: Proxy) -> list[web.RouteDef]:
    s = proxy.settings
    # A tokenize is the front of a prefill (the chat template, the tokenizer) without the
    # forward: it never needs longer than P's whole prefill may take.
    work = aiohttp.ClientTimeout(connect=s.connect_timeout_s, sock_read=s.prefill_timeout_s)

    def relay(path: str, timeout: aiohttp.ClientTimeout) -> web.RouteDef:
        async def handle(request: web.Request) -> web.Response:
            rid = client_request_id(request.headers) or uuid4_str()
            try:
                resp = await _forward(proxy, request, path, timeout, rid)
            except ProxyError as exc:
                resp = json_error(exc.status, exc.message, exc.err_type,
                                  headers={**exc.headers, "X-Request-Id": rid})
            proxy.metrics.passthrough.labels(path, str(resp.status)).inc()
            return resp
        return web.route("POST" if path in POSTS else "GET", path, handle)

    return [*(relay(p, work) for p in POSTS), *(relay(p, proxy.models_timeout) for p in GETS)]


async def _forward(proxy: Proxy, request: web.Request, path: str,
                   timeout: aiohttp.ClientTimeout, rid: str) -> web.Response:
    if proxy.shutting_down:
        raise ProxyError(503, "the proxy is shutting down")
    headers = {**proxy.base_headers, "X-Request-Id": rid}
    data = None
    if request.method == "POST":
        data = await request.read()  # read already, against body_timeout_s (intake)
        decode_object(data)  # D is sent JSON objects of a sane depth, or nothing
        headers["Content-Type"] = "application/json"
    assert proxy.session is not None
    tried: list[str] = []
    while True:
        d = await _decode_node(proxy, tried)
        try:
            async with proxy.session.request(request.method, f"{d.url}{path}", data=data,
                                             headers=headers, timeout=timeout) as up:
                raw = await up.read()
                status = up.status
                content_type = up.headers.get("Content-Type", "application/json")
            break
        except aiohttp.ClientConnectorError as exc:
            # Nothing reached D: another D answers, if there is one its checks have not
            # taken out of rotation yet.
            tried.append(d.url)
            if not [b for b in proxy.backends.ready_decode() if b.url not in tried]:
                raise ProxyError(502, f"decode node {d.url}: {_describe(exc)}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            timed_out = isinstance(exc, asyncio.TimeoutError)
            raise ProxyError(504 if timed_out else 502,
                             f"decode node {d.url}: {_describe(exc)}") from None
    if status >= 400:
        return web.json_response(upstream_error_body(status, raw, f"decode node {d.url}"),
                                 status=status, headers={"X-Request-Id": rid})
    return web.Response(status=status, body=raw,
                        headers={"Content-Type": content_type, "X-Request-Id": rid})


async def _decode_node(proxy: Proxy, tried: list[str]) -> Backend:
    """The least busy D in rotation not tried yet, waiting up to node_wait_s for one (a
    rollout's handover) before a 503, as a generation request does."""
    deadline = time.monotonic() + proxy.settings.node_wait_s
    while True:
        ready = [b for b in proxy.backends.ready_decode() if b.url not in tried]
        if ready:
            return min(ready, key=lambda b: b.in_flight)
        left = deadline - time.monotonic()
        if left <= 0 or proxy.shutting_down:
            raise ProxyError(503, "no decode node is healthy")
        await proxy.backends.rotation_changed(left)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
