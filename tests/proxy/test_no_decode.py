"""With no decode node in rotation (D down, restarting, drained), P serves requests whole
instead of the client getting a 503 (`fallback_to_prefill`), as a node with both engines
can; /ready says so too."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import MakeCluster


@pytest.mark.parametrize("stream", [False, True])
async def test_with_d_drained_p_answers_whole(make_cluster: MakeCluster, stream: bool) -> None:
    c = await make_cluster()
    async with c.http.post(f"{c.url}/admin/drain", json={"node": "decode"}) as r:
        assert r.status == 200
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": stream}
    status, answer, _ = await c.post(body=body)
    assert status == 200, answer
    (asked,) = c.prefill[0].bodies()
    assert "kv_transfer_params" not in asked and asked["max_tokens"] == 4  # whole, on P
    assert not c.decode[0].received
    metrics = await c.metrics()
    assert 'pd_proxy_prefill_fallbacks_total{reason="no_decode"} 1.0' in metrics
    async with c.http.get(f"{c.url}/ready") as r:
        assert r.status == 200


async def test_without_the_fallback_it_is_a_503(make_cluster: MakeCluster) -> None:
    c = await make_cluster(fallback_to_prefill=False, node_wait_s=0.2)
    async with c.http.post(f"{c.url}/admin/drain", json={"node": "decode"}) as r:
        assert r.status == 200
    status, answer, _ = await c.post()
    assert status == 503 and "no decode node" in answer["error"]["message"]
    assert not c.prefill[0].received
