"""Every failure path: the status the client sees, how long it took, and what upstream saw."""

from __future__ import annotations

import asyncio
import json
import time

from tests.proxy.conftest import Cluster, MakeCluster

STREAM = {"prompt": "hi", "max_tokens": 8, "stream": True}


async def _sse_events(c: Cluster, body: dict) -> tuple[int, list[str]]:
    async with c.http.post(f"{c.url}/v1/completions", json=body) as r:
        text = await r.text()
        return r.status, [e[len("data: "):] for e in text.split("\n\n") if e]


async def test_prefill_400_cancels_decode_waiting_for_kv(cluster: Cluster) -> None:
    p, d = cluster.prefill[0], cluster.decode[0]
    p.status, p.delay = 400, 0.2
    p.error_body = {"object": "error", "message": "prompt is too long (9000 > 8192 tokens)",
                    "type": "BadRequestError", "param": None, "code": 400}
    d.hang_after_headers = True  # D has answered 200 + SSE headers and waits for the KV
    status, data, elapsed = await cluster.post(body=STREAM)
    assert status == 400
    assert data == {"error": {"message": "prompt is too long (9000 > 8192 tokens)",
                              "type": "BadRequestError", "code": 400}}
    assert elapsed < 5
    await asyncio.wait_for(d.received[0].finished.wait(), 5)
    assert d.received[0].cancelled
    assert 'pd_proxy_requests_total{route="/v1/completions",status="400"} 1.0' \
        in await cluster.metrics()


async def test_prefill_500_is_passed_on_and_decode_cancelled(cluster: Cluster) -> None:
    p, d = cluster.prefill[0], cluster.decode[0]
    p.status, p.delay = 500, 0.1
    d.hang = True
    status, data, elapsed = await cluster.post()
    assert status == 500 and data["error"]["code"] == 500
    assert "p0 says no" in data["error"]["message"]
    assert elapsed < 5
    await asyncio.wait_for(d.received[0].finished.wait(), 5)
    assert d.received[0].cancelled


async def test_prefill_unreachable_falls_back_to_decode_alone(make_cluster: MakeCluster) -> None:
    # A long poll interval, so the proxy only learns of the outage from the request itself.
    c = await make_cluster(health_interval_s=60)
    await c.prefill[0].stop()
    status, data, elapsed = await c.post()
    assert status == 200 and data["choices"][0]["text"] == "t0 t1 t2 t3"
    assert elapsed < 5
    plain = [r for r in c.decode[0].received if r.kv is None]
    assert len(plain) == 1
    assert plain[0].body == {"model": "tiny", "prompt": "hello", "max_tokens": 8}
    for r in c.decode[0].received:
        if r.kv is not None:  # the split's D request was sent, then cancelled
            await asyncio.wait_for(r.finished.wait(), 5)
    assert 'pd_proxy_prefill_fallbacks_total{reason="prefill_unreachable"} 1.0' \
        in await c.metrics()
    st = await c.status()
    assert st["prefill"][0]["in_rotation"] is False  # taken out at once


async def test_prefill_timeout_falls_back_and_cancels_prefill(make_cluster: MakeCluster) -> None:
    c = await make_cluster(prefill_timeout_s=0.5)
    c.prefill[0].hang = True
    c.decode[0].hang_after_headers = True  # the split's D waits for KV; the plain one too...
    started = time.monotonic()
    task = asyncio.create_task(c.post(body=STREAM))
    await c.decode[0].wait_requests(2)  # ...so switch it off once the fallback arrives
    d_split, d_plain = c.decode[0].received
    assert d_split.kv is not None and d_plain.kv is None
    await asyncio.wait_for(d_split.finished.wait(), 5)
    assert d_split.cancelled
    await asyncio.wait_for(c.prefill[0].received[0].finished.wait(), 5)
    assert c.prefill[0].received[0].cancelled
    task.cancel()
    assert time.monotonic() - started < 5
    assert 'pd_proxy_prefill_fallbacks_total{reason="prefill_timeout"} 1.0' in await c.metrics()


async def test_prefill_timeout_answer(make_cluster: MakeCluster) -> None:
    c = await make_cluster(prefill_timeout_s=0.3)
    c.prefill[0].hang = True
    status, data, elapsed = await c.post()
    assert status == 200 and elapsed < 5
    assert c.decode[0].received[-1].kv is None


async def test_fallback_disabled_answers_503(make_cluster: MakeCluster) -> None:
    c = await make_cluster(health_interval_s=60, fallback_to_decode=False)
    await c.prefill[0].stop()
    status, data, elapsed = await c.post()
    assert status == 503 and "prefill node" in data["error"]["message"]
    assert data["error"]["type"] == "service_unavailable"
    assert elapsed < 5
    assert all(r.kv is not None for r in c.decode[0].received)


async def test_no_prefill_in_rotation_uses_fallback_after_startup(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    c.prefill[0].healthy = False
    await c.wait_for(lambda: _health_is(c, 503))
    status, _, _ = await c.post()
    assert status == 200
    assert len(c.prefill[0].received) == 0 and c.decode[0].received[0].kv is None
    assert 'pd_proxy_prefill_fallbacks_total{reason="no_prefill"} 1.0' in await c.metrics()


async def _health_is(c: Cluster, status: int) -> bool:
    return await c.health_status() == status


async def test_prefill_stopping_on_eos_keeps_decode(cluster: Cluster) -> None:
    # P's one token was EOS: this appliance's connector still sends the KV, so D serves on.
    cluster.prefill[0].finish_reason = "stop"
    status, _, _ = await cluster.post()
    assert status == 200
    assert len(cluster.decode[0].received) == 1 and cluster.decode[0].received[0].kv
    assert "prefill_stopped" not in await cluster.metrics()


async def test_prefill_stopping_on_eos_falls_back_when_asked(make_cluster: MakeCluster) -> None:
    # With vLLM's built-in connector no KV is sent for a stopped prefill; D would wait 480 s.
    cluster = await make_cluster(fallback_on_prefill_stop=True)
    cluster.prefill[0].finish_reason = "stop"
    cluster.decode[0].hang_after_headers = True
    task = asyncio.create_task(cluster.post(body=STREAM))
    await cluster.decode[0].wait_requests(2)
    split, plain = cluster.decode[0].received
    await asyncio.wait_for(split.finished.wait(), 5)
    assert split.cancelled and plain.kv is None
    task.cancel()
    assert 'reason="prefill_stopped"' in await cluster.metrics()


async def test_decode_unreachable_is_502_and_prefill_cancelled(make_cluster: MakeCluster) -> None:
    c = await make_cluster(health_interval_s=60, migration_limit=0)
    c.prefill[0].hang = True
    await c.decode[0].stop()
    status, data, elapsed = await c.post()
    assert status == 502 and "unreachable" in data["error"]["message"]
    assert data["error"]["type"] == "upstream_error"
    assert elapsed < 5
    await c.prefill[0].wait_requests(1)
    await asyncio.wait_for(c.prefill[0].received[0].finished.wait(), 5)
    assert c.prefill[0].received[0].cancelled


async def test_decode_500_before_first_byte_is_502(cluster: Cluster) -> None:
    cluster.decode[0].status = 500
    status, data, elapsed = await cluster.post(body=STREAM)
    assert status == 502 and "answered 500" in data["error"]["message"]
    assert elapsed < 5


async def test_decode_400_is_passed_on(cluster: Cluster) -> None:
    cluster.decode[0].status = 400
    status, data, _ = await cluster.post()
    assert status == 400 and data["error"]["message"] == "d0 says no"


async def test_decode_silent_before_first_byte_is_504(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decode_read_timeout_s=0.5)
    c.decode[0].hang = True
    status, data, elapsed = await c.post()
    assert status == 504 and elapsed < 5
    assert data["error"]["type"] == "timeout_error"
    await asyncio.wait_for(c.decode[0].received[0].finished.wait(), 5)
    assert c.decode[0].received[0].cancelled


async def test_decode_dying_mid_stream_ends_with_an_error_event(cluster: Cluster) -> None:
    d = cluster.decode[0]
    d.chunks, d.die_after = 5, 2
    status, events = await _sse_events(cluster, STREAM)
    assert status == 200
    assert len(events) == 3 and "[DONE]" not in events
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0 ", "t1 "]
    error = json.loads(events[2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    line = f'pd_proxy_upstream_errors_total{{backend="{d.url}",kind="stream",role="decode"}} 1.0'
    assert line in await cluster.metrics()


async def test_decode_stream_without_done_is_not_passed_off_as_success(cluster: Cluster) -> None:
    cluster.decode[0].skip_done = True
    status, events = await _sse_events(cluster, STREAM)
    assert status == 200 and len(events) == 5
    assert "before [DONE]" in json.loads(events[-1])["error"]["message"]


async def test_decode_stalling_mid_stream_ends_with_an_error_event(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(decode_read_timeout_s=0.4)
    c.decode[0].chunks, c.decode[0].chunk_delay = 3, 2.0
    started = time.monotonic()
    status, events = await _sse_events(c, STREAM)
    assert status == 200 and time.monotonic() - started < 5
    assert "timed out" in json.loads(events[-1])["error"]["message"]


async def test_client_disconnect_mid_stream_cancels_decode(cluster: Cluster) -> None:
    d = cluster.decode[0]
    d.chunks, d.chunk_delay = 100, 0.05
    async with cluster.http.post(f"{cluster.url}/v1/completions", json=STREAM) as r:
        assert r.status == 200
        await r.content.readline()
        r.close()  # drop the connection
    started = time.monotonic()
    await asyncio.wait_for(d.received[0].finished.wait(), 5)
    assert d.received[0].cancelled and d.received[0].chunks_sent < 100
    assert time.monotonic() - started < 5
    await cluster.wait_for(lambda: _in_flight_is(cluster, 0))


async def test_client_disconnect_during_prefill_cancels_both(cluster: Cluster) -> None:
    p, d = cluster.prefill[0], cluster.decode[0]
    p.hang = True
    d.hang_after_headers = True
    task = asyncio.create_task(cluster.post(body=STREAM))
    await p.wait_requests(1)
    await d.wait_requests(1)
    task.cancel()  # closes the client's connection
    await asyncio.wait_for(p.received[0].finished.wait(), 5)
    await asyncio.wait_for(d.received[0].finished.wait(), 5)
    assert p.received[0].cancelled and d.received[0].cancelled
    await cluster.wait_for(lambda: _in_flight_is(cluster, 0))
    assert 'status="499"' in await cluster.metrics()


async def _in_flight_is(c: Cluster, n: int) -> bool:
    st = await c.status()
    return st["in_flight"] == n and all(b["in_flight"] == 0
                                        for b in [*st["prefill"], *st["decode"]])


async def test_no_byte_of_d_reaches_the_client_before_p_succeeded(cluster: Cluster) -> None:
    """D (a fake) has streamed its whole answer before slow P says 400: the client must see
    P's 400, never D's tokens."""
    p, d = cluster.prefill[0], cluster.decode[0]
    p.status, p.delay = 400, 0.3
    status, data, elapsed = await cluster.post(body=STREAM)
    assert status == 400 and data["error"]["message"] == "p0 says no"
    assert elapsed >= 0.3
    assert d.received[0].chunks_sent == 4  # D did answer, and that answer was dropped


async def test_first_byte_waits_for_p(cluster: Cluster) -> None:
    cluster.prefill[0].delay = 0.3
    started = time.monotonic()
    async with cluster.http.post(f"{cluster.url}/v1/completions", json=STREAM) as r:
        first = await r.content.readany()
        ttfb = time.monotonic() - started
        rest = await r.read()
    assert first and ttfb >= 0.3
    assert (first + rest).endswith(b"data: [DONE]\n\n")
