"""bench/splitter.py: requests dealt out to the proxies in turn, streams passed as they
come, /health only when every proxy's is (in-process aiohttp servers on loopback)."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.benchmod import load

splitter = load("splitter")


async def _backend(name: str, seen: list[str]) -> TestServer:
    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(f"{name} {request.path} {(await request.json())['n']}")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {name}{i}\n\n".encode())
        await out.write_eof()
        return out

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_requests_go_to_each_proxy_in_turn() -> None:
    seen: list[str] = []
    backends = [await _backend(n, seen) for n in ("a", "b")]
    front = TestServer(splitter.app([str(b.make_url("")).rstrip("/") for b in backends]),
                       host="127.0.0.1")
    await front.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            assert (await http.get(front.make_url("/health"))).status == 200
            bodies = []
            for n in range(4):
                async with http.post(front.make_url("/v1/completions"), json={"n": n}) as r:
                    assert r.status == 200 and r.content_type == "text/event-stream"
                    bodies.append(await r.text())
            assert seen == ["a /v1/completions 0", "b /v1/completions 1",
                            "a /v1/completions 2", "b /v1/completions 3"]
            assert bodies[1] == "data: b0\n\ndata: b1\n\ndata: b2\n\n"
            await backends[1].close()
            assert (await http.get(front.make_url("/health"))).status == 503
    finally:
        await front.close()
        await backends[0].close()
