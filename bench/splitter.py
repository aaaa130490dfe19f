"""A front that deals requests out to several proxies in turn, as a load balancer in front
of a node's proxies does (per request, not per connection): so that one client's load, the
same requests at the same times, meets one proxy or several (bench/goodput.py
--two-proxies).

    python bench/splitter.py PORT URL [URL ...]

GET /health answers once every URL's /health does; every other request goes to the next
URL in turn, its answer streamed back as it comes.
"""

from __future__ import annotations

import asyncio
import itertools
import sys

import aiohttp
from aiohttp import web

_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def app(urls: list[str]) -> web.Application:
    turn = itertools.cycle(urls)
    session: aiohttp.ClientSession | None = None

    async def open_session(_: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                        connector=aiohttp.TCPConnector(limit=0))

    async def close_session(_: web.Application) -> None:
        if session is not None:
            await session.close()

    async def health(_: web.Request) -> web.Response:
        assert session is not None
        for url in urls:
            try:
                async with session.get(url + "/health") as r:
                    if r.status != 200:
                        return web.Response(status=503, text=f"{url}: {r.status}")
            except aiohttp.ClientError as exc:
                return web.Response(status=503, text=f"{url}: {exc}")
        return web.Response(text="ok")

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session.request(request.method, next(turn) + request.path_qs,
                                   headers=headers, data=await request.read()) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.on_startup.append(open_session)
    application.on_cleanup.append(close_session)
    application.router.add_get("/health", health)
    application.router.add_route("*", "/{tail:.*}", forward)
    return application


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: splitter.py PORT URL [URL ...]")
    port, urls = int(sys.argv[1]), [u.rstrip("/") for u in sys.argv[2:]]
    asyncio.set_event_loop(asyncio.new_event_loop())
    web.run_app(app(urls), host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main()
