"""A proxy in front of recording fakes: n prefill nodes (each with its bootstrap) and m decode
nodes, all on 127.0.0.1 with ephemeral ports."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from appliance.proxy import ProxySettings, RunningProxy, serve
from tests.proxy.fakes import FakeBootstrap, FakeVLLM

FAST = {
    "host": "127.0.0.1",
    "port": 0,
    "health_interval_s": 0.05,
    "health_timeout_s": 1.0,
    "connect_timeout_s": 1.0,
    "prefill_timeout_s": 3.0,
    "decode_read_timeout_s": 3.0,
    "drain_grace_s": 0.5,  # a cluster closed with a request in flight
    "node_wait_s": 0.2,  # a 503 for want of a node comes soon (test_ready.py waits longer)
    # These tests cover the classic split (both at once, D's first token); the first-token
    # mode has its own (test_first_token.py).
    "first_token_from_prefill": False,
    # They cover the remote paths (P, then D); adaptive placement has its own
    # (test_placement.py).
    "split": "always",
}


async def until(check: Callable[[], Awaitable[bool] | bool], timeout: float = 5.0) -> None:
    """Poll until check() holds; fail past a generous deadline (never a timing assert)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


class Cluster:
    def __init__(self, prefill: list[FakeVLLM], bootstraps: list[FakeBootstrap],
                 decode: list[FakeVLLM], proxy: RunningProxy,
                 http: aiohttp.ClientSession) -> None:
        self.prefill = prefill
        self.bootstraps = bootstraps
        self.decode = decode
        self.proxy = proxy
        self.http = http

    @property
    def url(self) -> str:
        return self.proxy.url

    def upstream_requests(self) -> int:
        return sum(len(n.received) for n in [*self.prefill, *self.decode])

    async def wait_for(self, check: Callable[[], Awaitable[bool] | bool],
                       timeout: float = 5.0) -> None:
        await until(check, timeout)

    async def health_status(self) -> int:
        async with self.http.get(f"{self.url}/health") as r:
            return r.status

    async def wait_ready(self) -> None:
        async def ready() -> bool:
            return await self.health_status() == 200
        await self.wait_for(ready)

    async def status(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/status") as r:
            return await r.json()

    async def post(self, path: str = "/v1/completions", body: Any = None,
                   headers: dict[str, str] | None = None) -> tuple[int, Any, float]:
        """Status, decoded JSON (or text) and seconds taken."""
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8} if body is None else body
        started = time.monotonic()
        async with self.http.post(f"{self.url}{path}", json=body, headers=headers) as r:
            text = await r.text()
            try:
                data: Any = await r.json(content_type=None)
            except ValueError:
                data = text
            return r.status, data, time.monotonic() - started

    async def metrics(self) -> str:
        async with self.http.get(f"{self.url}/metrics") as r:
            return await r.text()

    async def close_client(self) -> None:
        await self.http.close()

    async def counts_left(self, within_s: float = 3.0) -> dict[str, int]:
        """The counts requests hold on the proxy and its nodes that are not back to 0
        within `within_s` (a handler cancelled by its client ends a moment later)."""
        proxy = self.proxy.proxy

        def left() -> dict[str, int]:
            out = {"proxy.in_flight": proxy.in_flight}
            for b in proxy.backends.all():
                for counter in ("in_flight", "decodes", "prefilling", "prefill_tokens",
                                "transfers"):
                    out[f"{b.url}.{counter}"] = getattr(b, counter, 0)
            return {k: v for k, v in out.items() if v}
        deadline = time.monotonic() + within_s
        while left() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return left()

    async def close(self) -> None:
        await self.http.close()
        await self.proxy.close()
        for node in [*self.prefill, *self.bootstraps, *self.decode]:
            await node.stop()
        for b in self.bootstraps:
            if b.side is not None:
                b.side.close()

    def released(self, i: int = 0) -> list[str]:
        """Transfer ids whose KV the proxy released at prefill node i."""
        side = self.bootstraps[i].side
        assert side is not None
        return side.released


MakeCluster = Callable[..., Awaitable[Cluster]]


@pytest.fixture
async def make_cluster() -> AsyncIterator[MakeCluster]:
    made: list[Cluster] = []

    async def make(n_prefill: int = 1, n_decode: int = 1, dp_ranks: int = 1,
                   engines: bool = True, ready: bool = True,
                   upstream_tls: ssl.SSLContext | None = None, **overrides: Any) -> Cluster:
        prefill = [FakeVLLM(f"p{i}") for i in range(n_prefill)]
        bootstraps = [FakeBootstrap({r: f"engine-p{i}-dp{r}" for r in range(dp_ranks)}
                                    if engines else {}) for i in range(n_prefill)]
        decode = [FakeVLLM(f"d{i}") for i in range(n_decode)]
        for node in [*prefill, *bootstraps, *decode]:
            node.tls = upstream_tls
            await node.start()
        settings = ProxySettings.model_validate({
            **FAST,
            "prefill": [{"url": p.url, "bootstrap_url": b.url}
                        for p, b in zip(prefill, bootstraps, strict=True)],
            "decode": [{"url": d.url} for d in decode],
            **overrides,
        })
        proxy = await serve(settings)
        cluster = Cluster(prefill, bootstraps, decode, proxy,
                          aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)))
        made.append(cluster)
        if ready and engines:
            await cluster.wait_ready()
        return cluster

    yield make
    for cluster in made:
        await cluster.close_client()
        leaks = await cluster.counts_left()
        await cluster.close()
        # Whatever a test did, once its client is gone every request has given back what
        # it took (appliance.proxy.flight): no count is left on the proxy or a node.
        assert not leaks, f"counts left after the test: {leaks}"


@pytest.fixture
async def cluster(make_cluster: MakeCluster) -> Cluster:
    """1P1D, ready."""
    return await make_cluster()
