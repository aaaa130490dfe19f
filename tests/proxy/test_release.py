"""The proxy releases P's KV when no decode node will pull it, and only then.

P's side channel here is a real ZMQ ROUTER (tests.proxy.fakes.FakeSideChannel) named by
the fake bootstrap's /query, as the connector's workers are; what it receives is the
connector's own CancelRequest."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.proxy.conftest import Cluster, MakeCluster

STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
JSON = {"model": "tiny", "prompt": "hello", "max_tokens": 8}


async def _transfer_id(c: Cluster) -> str:
    await c.prefill[0].wait_requests(1)
    return c.prefill[0].received[0].kv["transfer_id"]


async def _released(c: Cluster, transfer_id: str) -> None:
    await c.wait_for(lambda: c.released() == [transfer_id])
    assert 'pd_proxy_kv_releases_total{outcome="sent"} 1.0' in await c.metrics()


async def _not_released(c: Cluster) -> None:
    await asyncio.sleep(0.3)  # a release is sent right after the request ends
    assert c.released() == []


async def _post(c: Cluster, body: dict[str, Any]) -> int:
    status, _, _ = await c.post(body=body)
    return status


# ---- classic split -----------------------------------------------------------------------

async def test_answered_by_decode_releases_nothing(cluster: Cluster) -> None:
    for body in (JSON, STREAM):
        assert await _post(cluster, body) == 200
    await _not_released(cluster)
    assert "pd_proxy_kv_releases_total{" not in await cluster.metrics()


async def test_decode_refusing_releases_prefill_kv(cluster: Cluster) -> None:
    """D's API server refused (400): its engine never saw the request, so its connector
    cannot free P's blocks; P would hold them for send_timeout_s."""
    cluster.decode[0].status = 400
    assert await _post(cluster, JSON) == 400
    await _released(cluster, await _transfer_id(cluster))


async def test_decode_failing_before_its_first_chunk_releases(cluster: Cluster) -> None:
    cluster.decode[0].status = 500
    assert await _post(cluster, STREAM) == 502
    await _released(cluster, await _transfer_id(cluster))


async def test_decode_failing_mid_stream_releases_nothing(cluster: Cluster) -> None:
    """D streamed: its engine had the request, its connector frees or pulls P's KV."""
    cluster.decode[0].die_after = 2
    assert await _post(cluster, STREAM) == 200
    await _not_released(cluster)


async def test_prefill_refusing_releases_nothing(cluster: Cluster) -> None:
    cluster.prefill[0].status = 400
    assert await _post(cluster, JSON) == 400
    await _not_released(cluster)


async def test_prefill_unreachable_releases_nothing(make_cluster: MakeCluster) -> None:
    c = await make_cluster(health_interval_s=60)
    await c.prefill[0].stop()
    assert await _post(c, JSON) == 200  # D alone
    await _not_released(c)


async def test_prefill_timing_out_releases(make_cluster: MakeCluster) -> None:
    """P may still finish the prefill after the proxy gave up on it: then it holds KV."""
    c = await make_cluster(prefill_timeout_s=0.3)
    c.prefill[0].hang = True
    assert await _post(c, JSON) == 200  # D alone
    await _released(c, await _transfer_id(c))


async def test_prefill_stopped_then_decode_alone_releases(make_cluster: MakeCluster) -> None:
    c = await make_cluster(fallback_on_prefill_stop=True)
    c.prefill[0].finish_reason = "stop"
    assert await _post(c, JSON) == 200
    assert c.decode[0].received[-1].kv is None  # the plain request
    await _released(c, await _transfer_id(c))


async def test_client_leaving_before_decode_answers_releases(cluster: Cluster) -> None:
    d = cluster.decode[0]
    d.hang_after_headers = True  # as vLLM: a stream's head before the engine has it
    task = asyncio.create_task(cluster.post(body=STREAM))
    await d.wait_requests(1)
    await asyncio.sleep(0.1)
    task.cancel()
    await _released(cluster, await _transfer_id(cluster))


async def test_client_leaving_after_decode_streamed_releases_nothing(cluster: Cluster) -> None:
    d = cluster.decode[0]
    d.chunks, d.chunk_delay = 100, 0.05
    async with cluster.http.post(f"{cluster.url}/v1/completions", json=STREAM) as r:
        await r.content.readuntil(b"\n\n")
        r.close()
    await asyncio.wait_for(d.received[0].finished.wait(), 5)
    await _not_released(cluster)


# ---- P's token first -----------------------------------------------------------------------

async def test_first_token_paths(make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True)
    # D continued after P's token: D pulled.
    assert await _post(c, STREAM) == 200
    # P's token ended the answer: P freed the KV by itself (send_on_stop false).
    c.prefill[0].finish_reason = "stop"
    assert await _post(c, STREAM) == 200
    await _not_released(c)
    # D refused the continuation after P's token went out.
    c.prefill[0].finish_reason = "length"
    c.decode[0].status = 400
    c.prefill[0].received.clear()
    assert await _post(c, STREAM) == 200  # the stream ends with an error event
    await _released(c, await _transfer_id(c))


async def test_first_token_client_leaving_after_p_token_releases(
        make_cluster: MakeCluster) -> None:
    """The CI failure this guards: the client hangs up after P's token while D's request
    is still being admitted; D's engine never sees it, so only the proxy can free P."""
    c = await make_cluster(first_token_from_prefill=True)
    c.decode[0].hang_after_headers = True
    async with c.http.post(f"{c.url}/v1/completions", json=STREAM) as r:
        await r.content.readuntil(b"\n\n")  # P's token
        r.close()
    await _released(c, await _transfer_id(c))


async def test_unknown_side_channel_is_counted_not_fatal(cluster: Cluster) -> None:
    poller = cluster.proxy.proxy.poller
    assert poller is not None
    await poller.stop()  # else the next poll learns the address again
    cluster.proxy.proxy.backends.prefill[0].side_channels = {}
    cluster.decode[0].status = 400
    assert await _post(cluster, JSON) == 400
    assert 'pd_proxy_kv_releases_total{outcome="no_address"} 1.0' in await cluster.metrics()
    assert cluster.released() == []


def test_proxy_imports_without_the_serving_stack() -> None:
    """The slim image (proxy, sidecar, pdctl) has no numpy, torch or vLLM; the release
    message comes from the side channel's messages (appliance.sidechannel), which must not
    need them."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('numpy', 'torch', 'vllm', 'mooncake'): sys.modules[name] = None\n"
            "import appliance.proxy.server, appliance.bootstrap.app, appliance.pdctl.cli\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_releaser_keeps_few_sockets(monkeypatch) -> None:
    """A restarted P worker listens on a new port: old sockets are closed, not hoarded."""
    from appliance.proxy.metrics import ProxyMetrics
    from appliance.proxy.nodes.backends import PrefillBackend
    from appliance.proxy.ownership import release
    from appliance.proxy.ownership.kv import PrefillKV

    monkeypatch.setattr(release, "_MAX_SOCKETS", 2)
    releaser = release.KVReleaser(ProxyMetrics())
    p = PrefillBackend("prefill", "http://127.0.0.1:1")
    try:
        for port in (5001, 5002, 5003):
            p.side_channels = {0: [f"tcp://127.0.0.1:{port}"]}
            releaser.release(PrefillKV(p, 0, f"x{port}"))
            await asyncio.sleep(0.05)
        assert list(releaser._socks) == ["tcp://127.0.0.1:5002", "tcp://127.0.0.1:5003"]
    finally:
        await releaser.close()
