"""Overload control: a limit of requests in flight per decode node and a bounded wait
queue; beyond it 429 with Retry-After at once, never a hang, and counted."""

from __future__ import annotations

import asyncio
import time

from tests.proxy.conftest import MakeCluster


async def _burst(c, n: int) -> list[tuple[int, float]]:
    async def one() -> tuple[int, float]:
        started = time.monotonic()
        status = (await c.post())[0]
        return status, time.monotonic() - started
    return await asyncio.gather(*(one() for _ in range(n)))


async def test_no_limit_no_429(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    c.decode[0].delay = 0.2
    assert {s for s, _ in await _burst(c, 20)} == {200}


async def test_beyond_limit_and_queue_429_with_retry_after(make_cluster: MakeCluster) -> None:
    c = await make_cluster(max_in_flight_per_decode=2, max_queued=3, queue_timeout_s=5)
    c.decode[0].delay = 0.5
    results = await _burst(c, 10)
    statuses = sorted(s for s, _ in results)
    assert statuses == [200] * 5 + [429] * 5  # 2 in flight + 3 queued, the rest refused
    assert all(t < 0.3 for s, t in results if s == 429)  # at once, not after a wait
    async with c.http.post(f"{c.url}/v1/completions",
                           json={"model": "tiny", "prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200  # the burst is over: a slot is free again
    c.decode[0].delay = 2.0
    tasks = [asyncio.create_task(c.post()) for _ in range(5)]  # 2 in flight, 3 waiting
    await c.decode[0].wait_requests(8)
    await asyncio.sleep(0.1)
    async with c.http.post(f"{c.url}/v1/completions",
                           json={"model": "tiny", "prompt": "x", "max_tokens": 1}) as r:
        body = await r.json()
        assert r.status == 429 and r.headers["Retry-After"] == "5"
        assert body["error"]["type"] == "rate_limit_error"
    await asyncio.gather(*tasks)
    metrics = await (await c.http.get(f"{c.url}/metrics")).text()
    assert 'pd_proxy_overloaded_total{reason="queue_full"} 6.0' in metrics


async def test_a_queued_request_gives_up_after_the_queue_timeout(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(max_in_flight_per_decode=1, max_queued=5, queue_timeout_s=0.3)
    c.decode[0].delay = 1.5
    results = await _burst(c, 3)
    assert sorted(s for s, _ in results) == [200, 429, 429]
    assert all(0.25 < t < 1.0 for s, t in results if s == 429)
    metrics = await (await c.http.get(f"{c.url}/metrics")).text()
    assert 'pd_proxy_overloaded_total{reason="queue_timeout"} 2.0' in metrics


async def test_a_full_node_takes_nothing_more_while_another_has_room(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2, max_in_flight_per_decode=2, max_queued=0)
    for d in c.decode:
        d.delay = 0.4
    statuses = sorted(s for s, _ in await _burst(c, 6))
    assert statuses == [200] * 4 + [429] * 2
    assert [len(d.received) for d in c.decode] == [2, 2]
