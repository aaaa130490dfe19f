"""Two proxies in front of one node: `auto` on one weighs what the other sent the same
engines (appliance.proxy.nodes.engineload), read off the engines' own gauges."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.e2e.conftest import token_prompt


async def _others(proxy: str, role: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy + "/status") as r:
            return (await r.json())[role][0]["others"]


async def _until(proxy: str, role: str, done, within: float) -> dict[str, int]:
    deadline = time.monotonic() + within
    while not done(got := await _others(proxy, role)):
        assert time.monotonic() < deadline, f"{role} others {got}"
        await asyncio.sleep(0.2)
    return got


async def test_decodes_another_proxy_runs_on_d_count_in_autos_estimates(split_proxies):
    """Three long streams through the `never` proxy (D alone): the `auto` proxy, which sent
    D nothing, counts them as D's running decodes, and forgets them once they end."""
    assert await _others(split_proxies["auto"], "decode") == {"waiting": 0, "running": 0}

    async def stream(http: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "tiny", "prompt": token_prompt(40, seed=4100 + i), "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}
        async with http.post(split_proxies["never"] + "/v1/completions", json=body) as r:
            assert r.status == 200
            async for _ in r.content:
                pass

    async with aiohttp.ClientSession() as http:
        load = asyncio.gather(*(stream(http, i) for i in range(3)))
        try:
            got = await _until(split_proxies["auto"], "decode",
                               lambda o: o["running"] + o["waiting"] >= 2, 30)
        finally:
            await load
    assert got["running"] + got["waiting"] <= 3
    await _until(split_proxies["auto"], "decode", lambda o: o == {"waiting": 0, "running": 0},
                 10)
