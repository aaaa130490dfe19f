"""Run-time membership (Backends.reconcile): a node added joins the rotation once its
health check passes; one removed leaves it at once, finishes what it holds and is then
dropped; one named again before it was dropped comes back."""

from __future__ import annotations

import asyncio
from typing import Any

from appliance.proxy.settings import DecodeNode, PrefillNode
from tests.proxy.conftest import Cluster, MakeCluster
from tests.proxy.fakes import FakeBootstrap, FakeVLLM


def _reconcile(c: Cluster, prefill: list[int] | None = None,
               decode: list[FakeVLLM] | None = None) -> None:
    """Hand the proxy this set: prefill node indices of the cluster, decode fakes."""
    ps = range(len(c.prefill)) if prefill is None else prefill
    c.proxy.proxy.backends.reconcile(
        [PrefillNode(url=c.prefill[i].url, bootstrap_url=c.bootstraps[i].url) for i in ps],
        [DecodeNode(url=d.url) for d in (c.decode if decode is None else decode)])


async def _nodes(c: Cluster, role: str) -> dict[str, dict[str, Any]]:
    return {n["url"]: n for n in (await c.status())[role]}


async def _in_rotation(c: Cluster, role: str, url: str) -> bool:
    node = (await _nodes(c, role)).get(url)
    return node is not None and node["in_rotation"]


async def test_an_added_node_serves_once_its_health_check_passes(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    d1 = FakeVLLM("d1")
    d1.healthy = False
    await d1.start()
    c.decode.append(d1)  # stopped with the cluster
    _reconcile(c)
    node = (await _nodes(c, "decode"))[d1.url]
    assert not node["in_rotation"] and not node["leaving"]
    for _ in range(4):
        assert (await c.post())[0] == 200
    assert d1.received == []  # unhealthy: out of rotation, as at start-up
    d1.healthy = True
    await c.wait_for(lambda: _in_rotation(c, "decode", d1.url))
    for _ in range(4):
        assert (await c.post())[0] == 200
    assert len(d1.received) == 2  # round robin over both
    metrics = await c.metrics()
    assert 'pd_proxy_backend_membership_changes_total{change="added",role="decode"} 2.0' \
        in metrics
    assert 'pd_proxy_backends{role="decode"} 2.0' in metrics


async def test_a_removed_node_finishes_its_request_then_is_dropped(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2)
    d0, d1 = c.decode
    d0.delay = 1.5
    slow = asyncio.create_task(c.post())
    await d0.wait_requests(1)
    up = f'pd_proxy_backend_up{{backend="{d0.url}",role="decode"}}'
    assert up in await c.metrics()
    _reconcile(c, decode=[d1])
    node = (await _nodes(c, "decode"))[d0.url]
    assert node["leaving"] and not node["in_rotation"] and node["in_flight"] == 1
    for _ in range(3):  # while d0 still holds its request
        assert (await c.post())[0] == 200
    assert len(d0.received) == 1 and len(d1.received) == 3
    assert (await slow)[0] == 200  # what it had finished
    await c.wait_for(lambda: _gone(c, d0.url))
    assert up not in await c.metrics()
    assert d0.url not in await c.metrics()  # no series of a node that is gone
    d0.delay = 0.0
    _reconcile(c, decode=[d0, d1])  # added again: a new member, checked first
    await c.wait_for(lambda: _in_rotation(c, "decode", d0.url))
    for _ in range(4):
        assert (await c.post())[0] == 200
    assert len(d0.received) == 3


async def _gone(c: Cluster, url: str) -> bool:
    return url not in await _nodes(c, "decode")


async def test_a_node_named_again_before_it_was_dropped_comes_back(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2)
    d0, d1 = c.decode
    d0.delay = 1.0
    slow = asyncio.create_task(c.post())
    await d0.wait_requests(1)
    backend = c.proxy.proxy.backends.find(d0.url)[0]
    _reconcile(c, decode=[d1])
    assert not backend.in_rotation
    _reconcile(c, decode=[d0, d1])
    assert backend.in_rotation and c.proxy.proxy.backends.find(d0.url) == [backend]
    d0.delay = 0.0
    assert (await slow)[0] == 200
    for _ in range(2):
        assert (await c.post())[0] == 200
    assert len(d0.received) == 2
    assert 'change="returned",role="decode"} 1.0' in await c.metrics()


async def test_a_prefill_that_left_still_gets_its_kv_released(
        make_cluster: MakeCluster) -> None:
    """P removed while its request is in flight: the request ends (here D refuses), the
    release goes to the side channels of the P that left, and P is dropped after."""
    c = await make_cluster(n_prefill=2)
    p0 = c.prefill[0]
    p0.delay, c.decode[0].delay, c.decode[0].status = 2.0, 1.0, 400
    ask = asyncio.create_task(c.post())
    await p0.wait_requests(1)
    _reconcile(c, prefill=[1])
    assert (await _nodes(c, "prefill"))[p0.url]["leaving"]
    assert (await ask)[0] == 400
    transfer_id = p0.received[0].kv["transfer_id"]
    await c.wait_for(lambda: c.released(0) == [transfer_id])
    await c.wait_for(lambda: _prefill_gone(c, p0.url))
    c.decode[0].delay, c.decode[0].status = 0.0, 200
    for _ in range(2):
        assert (await c.post())[0] == 200
    assert len(p0.received) == 1 and len(c.prefill[1].received) == 2


async def _prefill_gone(c: Cluster, url: str) -> bool:
    return url not in await _nodes(c, "prefill")


async def test_a_moved_bootstrap_is_queried_again(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    other = FakeBootstrap({0: "engine-moved"})
    await other.start()
    c.bootstraps.append(other)  # stopped with the cluster
    c.proxy.proxy.backends.reconcile(
        [PrefillNode(url=c.prefill[0].url, bootstrap_url=other.url)],
        [DecodeNode(url=c.decode[0].url)])

    async def moved() -> bool:
        p = (await _nodes(c, "prefill"))[c.prefill[0].url]
        return p["engine_ids"] == {"0": "engine-moved"} and p["in_rotation"]
    await c.wait_for(moved)
    assert (await c.post())[0] == 200
    assert c.decode[0].received[-1].kv["remote_bootstrap_addr"] == other.url


def test_a_dropped_nodes_series_all_go() -> None:
    """Every series labelled with a dropped node's URL (its up gauge, the prefix index's
    predictions, its upstream errors) leaves /metrics; the other node's stay."""
    from appliance.proxy.metrics import ProxyMetrics

    m = ProxyMetrics()
    for url in ("http://a:1", "http://b:1"):
        m.backend_up.labels("decode", url).set(1)
        m.prefix_hits.labels("decode", url).inc(8)
        m.prefix_queries.labels("decode", url).inc(16)
        for kind in ("timeout", "connect"):
            m.upstream_errors.labels("decode", url, kind).inc()
    m.forget_backend("decode", "http://a:1")
    text = m.render().decode()
    assert "http://a:1" not in text
    assert text.count('backend="http://b:1"') >= 5
