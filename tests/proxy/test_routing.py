"""Readiness, round robin, least outstanding, and nodes leaving and rejoining the rotation."""

from __future__ import annotations

import asyncio

import pytest

from tests.proxy.conftest import Cluster, MakeCluster


def _picks(c: Cluster) -> tuple[list[str], list[str]]:
    """Which P and D each request went to, in arrival order (by transfer id)."""
    p = sorted((r.at, n.name) for n in c.prefill for r in n.received)
    d = sorted((r.at, n.name) for n in c.decode for r in n.received)
    return [name for _, name in p], [name for _, name in d]


async def test_readiness_waits_for_an_engine_id(make_cluster: MakeCluster) -> None:
    c = await make_cluster(engines=False)
    await c.wait_for(lambda: c.bootstraps[0].queries >= 2)
    async with c.http.get(f"{c.url}/health") as r:
        assert r.status == 503
        body = await r.json()
    assert body["status"] == "unavailable" and "engine id" in body["reason"]
    status, data, _ = await c.post()
    assert status == 503 and "engine id" in data["error"]["message"]
    assert c.upstream_requests() == 0
    c.bootstraps[0].engines = {0: "engine-late"}
    await c.wait_ready()
    status, _, _ = await c.post()
    assert status == 200
    assert c.decode[0].received[0].kv["remote_engine_id"] == "engine-late"


async def test_health_needs_a_decode_node(make_cluster: MakeCluster) -> None:
    c = await make_cluster(fallback_to_prefill=False)  # else P answers (test_no_decode)
    c.decode[0].healthy = False
    await c.wait_for(lambda: _health_is(c, 503))
    async with c.http.get(f"{c.url}/health") as r:
        assert (await r.json())["reason"] == "no decode node is healthy"
    status, _, _ = await c.post()
    assert status == 503
    assert c.upstream_requests() == 0


async def _health_is(c: Cluster, status: int) -> bool:
    return await c.health_status() == status


async def test_round_robin_across_2p_2d(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2, n_decode=2)
    for _ in range(4):
        assert (await c.post())[0] == 200
    p, d = _picks(c)
    assert p == ["p0", "p1", "p0", "p1"]
    assert d == ["d0", "d1", "d0", "d1"]
    # D is always told the bootstrap and engine of the P that prefilled its request.
    for node in c.decode:
        for r in node.received:
            owner = next(i for i, pn in enumerate(c.prefill)
                         if any(x.kv["transfer_id"] == r.kv["transfer_id"] for x in pn.received))
            assert r.kv["remote_bootstrap_addr"] == c.bootstraps[owner].url
            assert r.kv["remote_engine_id"] == f"engine-p{owner}-dp0"


async def test_dp_ranks_of_one_p_are_used_in_turn(make_cluster: MakeCluster) -> None:
    c = await make_cluster(dp_ranks=2)
    for _ in range(4):
        assert (await c.post())[0] == 200
    engines = [r.kv["remote_engine_id"] for r in c.decode[0].received]
    assert engines == ["engine-p0-dp0", "engine-p0-dp1"] * 2


@pytest.mark.parametrize("first_token", [False, True])
async def test_each_prefill_runs_in_the_dp_rank_d_pulls_from(make_cluster: MakeCluster,
                                                              first_token: bool) -> None:
    """P's API server fronts two dp ranks: P's request names the rank whose engine id D is
    given (X-data-parallel-rank, as vLLM's example proxy sends it), else P's server picks a
    rank by itself and D waits on the other engine for KV that never comes."""
    c = await make_cluster(dp_ranks=2, first_token_from_prefill=first_token)
    for _ in range(4):
        assert (await c.post(body={"prompt": "hi", "max_tokens": 5, "stream": True}))[0] == 200
    rank_of = {r.kv["transfer_id"]: r.headers.get("X-data-parallel-rank")
               for r in c.prefill[0].received}
    pulled = {r.kv["transfer_id"]: r.kv["remote_engine_id"] for r in c.decode[0].received}
    assert len(pulled) == 4 and set(rank_of.values()) == {"0", "1"}
    for transfer_id, engine in pulled.items():
        assert engine == f"engine-p0-dp{rank_of[transfer_id]}"


async def test_a_single_rank_gets_no_rank_header(make_cluster: MakeCluster) -> None:
    """No DP, or one rank per API server behind an external balancer: such a server takes
    only its local rank index, so the header is left out."""
    c = await make_cluster(dp_ranks=1)
    assert (await c.post())[0] == 200
    assert "X-data-parallel-rank" not in c.prefill[0].received[0].headers


async def test_least_outstanding_across_2p_2d(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2, n_decode=2, policy="least_outstanding")
    slow = c.decode[0]
    slow.chunks, slow.chunk_delay = 20, 0.1  # d0 stays busy with the first request
    first = asyncio.create_task(c.post(body={"prompt": "long", "stream": True}))
    await slow.wait_requests(1)
    for _ in range(3):
        assert (await c.post())[0] == 200
    assert len(slow.received) == 1
    assert len(c.decode[1].received) == 3
    # P answers at once, so its in-flight count is back to 0 and P goes in turn.
    p, _ = _picks(c)
    assert p == ["p0", "p1", "p0", "p1"]
    status = await c.status()
    assert [n["in_flight"] for n in status["decode"]] == [1, 0]
    assert status["in_flight"] == 1
    assert (await first)[0] == 200


async def test_decode_node_down_and_back(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2)
    c.decode[0].healthy = False
    await c.wait_for(lambda: _decode_in_rotation(c, [False, True]))
    for _ in range(3):
        assert (await c.post())[0] == 200
    assert len(c.decode[0].received) == 0 and len(c.decode[1].received) == 3
    assert f'pd_proxy_backend_up{{backend="{c.decode[0].url}",role="decode"}} 0.0' \
        in await c.metrics()
    c.decode[0].healthy = True
    await c.wait_for(lambda: _decode_in_rotation(c, [True, True]))
    for _ in range(2):
        assert (await c.post())[0] == 200
    assert len(c.decode[0].received) == 1 and len(c.decode[1].received) == 4


async def _decode_in_rotation(c: Cluster, expected: list[bool]) -> bool:
    return [n["in_rotation"] for n in (await c.status())["decode"]] == expected


async def test_prefill_node_stopped_and_restarted(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2)
    p0 = c.prefill[0]
    await p0.stop()
    await c.wait_for(lambda: _prefill_in_rotation(c, [False, True]))
    for _ in range(2):
        assert (await c.post())[0] == 200
    assert len(c.prefill[1].received) == 2
    # A restarted P comes back with a new engine id, which is the one D must be told.
    c.bootstraps[0].engines = {0: "engine-p0-restarted"}
    await p0.start()
    await c.wait_for(lambda: _prefill_in_rotation(c, [True, True]))
    for _ in range(2):
        assert (await c.post())[0] == 200
    assert len(p0.received) == 1
    assert "engine-p0-restarted" in [r.kv["remote_engine_id"] for r in c.decode[0].received]


async def test_bootstrap_failure_takes_p_out(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2)
    c.bootstraps[1].fail = True
    await c.wait_for(lambda: _prefill_in_rotation(c, [True, False]))
    st = await c.status()
    assert st["prefill"][1]["healthy"] is True and st["prefill"][1]["engine_ids"] == {}
    assert st["prefill"][1]["last_error"].startswith("bootstrap:")
    for _ in range(2):
        assert (await c.post())[0] == 200
    assert len(c.prefill[1].received) == 0


async def _prefill_in_rotation(c: Cluster, expected: list[bool]) -> bool:
    return [n["in_rotation"] for n in (await c.status())["prefill"]] == expected


async def test_least_outstanding_prefill(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2, policy="least_outstanding")
    c.prefill[0].delay = 1.0  # p0 is busy prefilling the first request
    first = asyncio.create_task(c.post())
    await c.prefill[0].wait_requests(1)
    c.prefill[0].delay = 0
    for _ in range(3):
        assert (await c.post())[0] == 200
    assert len(c.prefill[0].received) == 1 and len(c.prefill[1].received) == 3
    assert (await first)[0] == 200
