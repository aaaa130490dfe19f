"""P goes down after it answered, while D waits for its KV (P frozen mid-transfer): the
proxy's health checks find it within seconds and D's call is asked again on D alone, into
the same client answer, instead of waiting for D's recv_timeout_s. A D call that already
answered is left alone: D's connector owns that KV."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.proxy.conftest import Cluster, MakeCluster
from tests.proxy.test_first_token import completion, texts
from tests.proxy.test_first_token import stream as ft_stream

SLOW = {"prefill_timeout_s": 60.0, "decode_read_timeout_s": 60.0}


async def _p_goes_down(c: Cluster) -> float:
    """D got the request that waits for KV; P's health checks fail from now on."""
    await c.decode[0].wait_requests(1)
    await asyncio.sleep(0.1)
    c.prefill[0].healthy = False
    return time.monotonic()


def _second_call_alone(c: Cluster) -> dict[str, Any]:
    first, second = c.decode[0].received
    assert first.kv is not None and first.cancelled  # the call that waited was cut
    assert "kv_transfer_params" not in second.body
    return second.body


async def test_a_waiting_decode_call_goes_to_d_alone(make_cluster: MakeCluster) -> None:
    c = await make_cluster(**SLOW)
    c.decode[0].wait_for_kv = True
    task = asyncio.create_task(c.post())
    started = await _p_goes_down(c)
    status, body, _ = await asyncio.wait_for(task, 10)
    assert status == 200 and body["choices"][0]["text"] == "t0 t1 t2 t3"
    assert time.monotonic() - started < 3  # not D's 60 s read timeout
    assert _second_call_alone(c)["prompt"] == "hello"
    xfer = c.prefill[0].received[0].kv["transfer_id"]
    await c.wait_for(lambda: xfer in c.released())  # queued for P: nobody pulls it now
    assert 'pd_proxy_prefill_fallbacks_total{reason="prefill_down"} 1.0' in await c.metrics()


async def test_a_waiting_stream_continues_in_the_same_answer(make_cluster: MakeCluster) -> None:
    c = await make_cluster(**SLOW)
    c.decode[0].wait_for_kv = True
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
    task = asyncio.create_task(c.post(body=body))
    await _p_goes_down(c)
    status, text, _ = await asyncio.wait_for(task, 10)
    assert status == 200
    assert "error" not in text and text.count("[DONE]") == 1 and text.count("t0 ") == 1
    _second_call_alone(c)


async def test_a_first_token_continuation_goes_to_d_alone(make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True, **SLOW)
    c.decode[0].wait_for_kv = True
    task = asyncio.create_task(ft_stream(c, "/v1/completions", completion(temperature=0)))
    await _p_goes_down(c)
    status, evs = await asyncio.wait_for(task, 10)
    assert status == 200 and texts(evs) == "t0" + "t0 t1 t2 t3 " and evs[-1] == "[DONE]"
    alone = _second_call_alone(c)
    assert alone["prompt"] == [1, 2, 3, 4, 5, 7]  # P's prompt ids and token, recomputed


async def test_a_decode_call_that_answered_is_left_alone(make_cluster: MakeCluster) -> None:
    c = await make_cluster(**SLOW)
    d = c.decode[0]
    d.chunk_delay = 0.4
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
    task = asyncio.create_task(c.post(body=body))
    await d.wait_requests(1)
    await c.wait_for(lambda: d.received[0].chunks_sent >= 1)
    c.prefill[0].healthy = False
    status, text, _ = await asyncio.wait_for(task, 10)
    assert status == 200 and "error" not in text and "[DONE]" in text
    assert len(d.received) == 1 and not d.received[0].cancelled
    assert c.prefill[0].received[0].kv["transfer_id"] not in c.released()


async def test_a_client_leaving_the_retried_stream_cuts_d(make_cluster: MakeCluster) -> None:
    c = await make_cluster(**SLOW)
    d = c.decode[0]
    d.wait_for_kv, d.chunk_delay, d.chunks = True, 0.3, 20
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
    async with c.http.post(f"{c.url}/v1/completions", json=body) as r:
        await _p_goes_down(c)
        await d.wait_requests(2)
        await r.content.readline()  # the retried stream's first event
    await c.wait_for(lambda: d.received[1].finished.is_set())
    assert d.received[1].cancelled  # D stops generating for a client that left
