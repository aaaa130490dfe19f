"""GET /ready: 200 exactly when the proxy would answer a request (the chart's readiness
probe), unlike /health, which also wants a P; open without a key like /health."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.proxy.conftest import Cluster, MakeCluster


async def _ready(c: Cluster, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with c.http.get(f"{c.url}/ready", headers=headers) as r:
        return r.status, await r.json()


async def _ready_is(c: Cluster, status: int) -> bool:
    return (await _ready(c))[0] == status


async def test_ready_with_p_and_d(cluster: Cluster) -> None:
    assert await _ready(cluster) == (200, {"status": "ok", "reason": None})


async def test_a_p_outage_keeps_it_ready_while_d_answers_alone(make_cluster: MakeCluster) -> None:
    """One P crashing (or rolling) must not empty the proxy's Service: D answers alone."""
    c = await make_cluster()
    c.prefill[0].healthy = False

    async def health_down() -> bool:
        return await c.health_status() == 503  # /health wants a P

    await c.wait_for(health_down)
    assert await _ready(c) == (200, {"status": "ok", "reason": None})
    status, _, _ = await c.post()
    assert status == 200  # what /ready promised
    assert c.decode[0].received and not c.prefill[0].received


async def test_no_fallback_needs_a_p(make_cluster: MakeCluster) -> None:
    c = await make_cluster(fallback_to_decode=False)
    assert (await _ready(c))[0] == 200
    c.prefill[0].healthy = False
    await c.wait_for(lambda: _ready_is(c, 503))
    status, body = await _ready(c)
    assert body["status"] == "unavailable" and "prefill" in body["reason"]
    assert body["error"] == {"message": body["reason"], "type": "service_unavailable",
                             "code": 503}
    assert (await c.post())[0] == 503


async def test_no_decode_is_not_ready(make_cluster: MakeCluster) -> None:
    c = await make_cluster(fallback_to_prefill=False)  # else P answers (test_no_decode)
    c.decode[0].healthy = False
    await c.wait_for(lambda: _ready_is(c, 503))
    assert (await _ready(c))[1]["reason"] == "no decode node is healthy"


async def test_not_ready_before_any_engine_id(make_cluster: MakeCluster) -> None:
    c = await make_cluster(engines=False)
    await c.wait_for(lambda: c.bootstraps[0].queries >= 2)
    status, body = await _ready(c)
    assert status == 503 and "engine id" in body["reason"]
    status, data, _ = await c.post()
    assert status == 503 and data["error"]["message"] == body["reason"]


async def test_not_ready_while_shutting_down(cluster: Cluster) -> None:
    cluster.proxy.proxy.shutting_down = True
    status, body = await _ready(cluster)
    assert status == 503 and body["reason"] == "the proxy is shutting down"


async def test_ready_needs_no_key(make_cluster: MakeCluster) -> None:
    c = await make_cluster(api_keys=["k"], auth_ops_endpoints=True)
    assert (await _ready(c))[0] == 200
    assert not c.proxy.proxy.needs_auth("/ready")
    async with c.http.get(f"{c.url}/status") as r:
        assert r.status == 401  # the ops endpoints are keyed, /ready is not


async def test_a_request_waits_moments_for_a_node_rather_than_a_503(
        make_cluster: MakeCluster) -> None:
    """No D in rotation for a moment (a rollout's handover: the new D's first check not yet
    done when the old one leaves): a request waits up to node_wait_s for one to come back,
    and gets a 503 only past it."""
    c = await make_cluster(node_wait_s=10.0, fallback_to_prefill=False)
    c.decode[0].healthy = False
    await c.wait_for(lambda: _ready_is(c, 503))
    pending = asyncio.ensure_future(c.post())
    await asyncio.sleep(0.5)
    assert not pending.done()  # waiting, not refused
    c.decode[0].healthy = True
    status, _, _ = await asyncio.wait_for(pending, 10)
    assert status == 200

    short = await make_cluster(node_wait_s=0.3, fallback_to_prefill=False)
    short.decode[0].healthy = False
    await short.wait_for(lambda: _ready_is(short, 503))
    begin = time.monotonic()
    status, body, _ = await short.post()
    assert status == 503 and "no decode node is healthy" in str(body)
    assert time.monotonic() - begin >= 0.3
