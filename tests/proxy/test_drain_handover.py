"""A drained node still answering after `handover_after_s` (default `drain_handover_s`) hands
its answers over (appliance.proxy.nodes.handover): a stream goes on from another engine
after the tokens the client has, whole and without a gap, and the node holds nothing."""

from __future__ import annotations

import asyncio
import time

from appliance.proxy.nodes.handover import due
from tests.proxy.conftest import MakeCluster
from tests.proxy.test_first_token import completion, stream, texts


def test_a_node_hands_over_once_its_wait_is_over() -> None:
    assert not due(10.0, 12.0, 5.0)
    assert due(10.0, 15.0, 5.0)
    assert not due(10.0, 1e9, 0.0)  # 0: never


async def _drain(c, node: str, **extra: object) -> int:
    async with c.http.post(f"{c.url}/admin/drain", json={"node": node, **extra}) as r:
        return r.status


async def test_a_drained_decode_hands_its_stream_over_to_p(make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True)
    d = c.decode[0]
    d.chunk_delay = 0.4  # an answer longer than the drain may wait
    task = asyncio.create_task(stream(c, "/v1/completions", completion()))
    await d.wait_requests(1)
    await c.wait_for(lambda: d.received[0].chunks_sent >= 2)
    started = time.monotonic()
    assert await _drain(c, "decode", handover_after_s=0.3) == 200
    status, evs = await asyncio.wait_for(task, 10)
    assert time.monotonic() - started < 1.5  # not D's remaining 0.8 s of tokens
    assert status == 200 and texts(evs) == "t0t0 t1 t2 t3 ", evs  # no gap, no repeat
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs if isinstance(e, dict))
    assert d.received[0].cancelled  # D's call was cut: vLLM aborts it and frees its blocks
    metrics = await c.metrics()
    assert 'pd_proxy_migrations_total{how="continued"} 1.0' in metrics


async def test_without_a_handover_the_drain_waits_for_the_answer(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True, drain_handover_s=0)
    d = c.decode[0]
    d.chunk_delay = 0.3
    task = asyncio.create_task(stream(c, "/v1/completions", completion()))
    await d.wait_requests(1)
    assert await _drain(c, "decode") == 200
    status, evs = await asyncio.wait_for(task, 10)
    assert status == 200 and texts(evs) == "t0t0 t1 t2 t3 "
    assert not d.received[0].cancelled  # D answered it to its end
    assert "pd_proxy_migrations_total{" not in await c.metrics()


async def test_a_bad_handover_is_refused(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    for bad in (-1, "soon", True):
        assert await _drain(c, "decode", handover_after_s=bad) == 400
