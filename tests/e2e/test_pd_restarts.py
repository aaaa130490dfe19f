"""Parts of a running node restarted, killed or stalled, as SREs meet it (real vLLM P and D
on CPU, the tiny model): the bootstrap sidecar restarted (requests keep flowing, P
re-registers within its TTL), P killed while idle and restarted (D's next pulls go to the
new P at once), the proxy killed mid-request (P's orphaned KV is freed), D
killed mid-stream (a stream that cannot go on elsewhere ends with an SSE error, P holds
nothing), D stalled past the
proxy's read timeout (an error, P's KV released). Each ends with every request answered,
nothing held, and a plain server's output."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from appliance.process import ServiceProcess
from tests.conftest import free_port
from tests.e2e.conftest import (
    plain_request,
    running_node,
    second_proxy,
    text_of,
    token_prompt,
)
from tests.e2e.observe import (
    in_rotation,
    kv_usage,
    metric,
    prefills_answered,
    served_from_p,
    timed_ask,
    wait_no_blocks_held,
)

pytestmark = pytest.mark.slow

TTL_S = 30.0  # the sidecar's; P's workers register every 10 s
BOUND_S = 15


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    with running_node(tiny_model, tmp_path_factory.mktemp("restarts"),
                      proxy_port=free_port(), bootstrap_ttl=TTL_S) as n:
        yield n


def _body(i: int, stream: bool = False, max_tokens: int = 6) -> dict:
    return {"model": "tiny", "prompt": token_prompt(20 + 11 * i, seed=1100 + i),
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def _expected(plain_server: str, ids: range) -> dict[int, str]:
    return {i: text_of(await plain_request(plain_server, "/v1/completions", _body(i)))
            for i in ids}


def _kill(svc: ServiceProcess) -> None:
    os.killpg(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(10)


async def _restart(svc: ServiceProcess) -> None:
    svc.start()
    await asyncio.to_thread(svc.wait_healthy, 300)


async def _p_usage_zero(node, within: float) -> float:
    """Seconds until P holds no block."""
    started = time.monotonic()
    while kv_usage(node.spec.prefill_url) > 0:
        assert time.monotonic() - started < within, "P still holds blocks"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_sidecar_restarted_requests_keep_flowing(node, plain_server):
    expected = await _expected(plain_server, range(6))
    results: list[tuple[int, int, str]] = []
    stop = asyncio.Event()

    async def client() -> None:
        k = 0
        while not stop.is_set() and k < 200:  # bounded
            i = k % 6
            status, text, _ = await timed_ask(node.spec.proxy_url, _body(i))
            results.append((i, status, text))
            k += 1

    task = asyncio.create_task(client())
    await asyncio.sleep(1)
    _kill(node.bootstrap)
    await asyncio.sleep(2)
    await _restart(node.bootstrap)
    restarted = time.monotonic()
    await in_rotation(node, "prefill", within=TTL_S)  # P's workers registered again
    print(f"P back in rotation {time.monotonic() - restarted:.1f} s after the sidecar")
    await asyncio.sleep(1)
    stop.set()
    await asyncio.wait_for(task, 60)
    assert results and [r for r in results if r[1] != 200] == []
    assert [r for r in results if r[2] != expected[r[0]]] == []
    await served_from_p(node, _body(0), expected[0])
    await wait_no_blocks_held(node, within=60)


async def _long(plain_server: str, i: int) -> tuple[dict, str]:
    body = {**_body(i, max_tokens=120), "ignore_eos": True}
    return body, text_of(await plain_request(plain_server, "/v1/completions", body))


def _p_requests(node) -> float:
    return metric(node.spec.prefill_url, "vllm:request_success_total")


async def test_drained_prefill_finishes_its_work_and_gets_nothing_new(node, plain_server):
    long_body, long_want = await _long(plain_server, 4)
    expected = await _expected(plain_server, range(3))
    url = node.spec.proxy_url
    asks = [asyncio.create_task(timed_ask(url, long_body)) for _ in range(3)]
    done = metric(node.spec.proxy_url, "pd_proxy_prefill_seconds_count")
    async with aiohttp.ClientSession() as http:
        await prefills_answered(node, done + 3)
        drain = {"node": node.spec.prefill_url}
        async with http.post(url + "/admin/drain", json=drain) as r:
            assert r.status == 200, await r.text()
        seen = _p_requests(node)
        for i in range(3):  # new work goes to D alone meanwhile
            status, text, _ = await timed_ask(url, _body(i))
            assert (status, text) == (200, expected[i])
        assert _p_requests(node) == seen  # P got nothing new
        for status, text, _ in await asyncio.gather(*asks):
            assert (status, text) == (200, long_want)  # what it had, finished
        async with http.post(url + "/admin/undrain", json=drain) as r:
            assert r.status == 200
    await in_rotation(node, "prefill")
    status, text, _ = await timed_ask(url, _body(0))
    assert (status, text) == (200, expected[0]) and _p_requests(node) > seen
    await wait_no_blocks_held(node, within=60)


async def test_sigterm_to_the_proxy_loses_no_started_request(node, plain_server):
    long_body, long_want = await _long(plain_server, 5)
    assert node.proxy is not None
    asks = [asyncio.create_task(timed_ask(node.spec.proxy_url, {**long_body, "stream": s}))
            for s in (False, True, False, True)]
    await asyncio.sleep(1.0)  # started: P asked, or D streaming
    node.proxy.proc.send_signal(signal.SIGTERM)
    for status, text, _ in await asyncio.gather(*asks):
        assert (status, text) == (200, long_want)
    assert await asyncio.to_thread(node.proxy.proc.wait, 20) == 0
    await _restart(node.proxy)
    await in_rotation(node, "prefill")
    await wait_no_blocks_held(node, within=60)


async def test_proxy_killed_mid_request_orphans_nothing(node, plain_server):
    expected = await _expected(plain_server, range(2))
    done = metric(node.spec.proxy_url, "pd_proxy_prefill_seconds_count")
    asks = [asyncio.create_task(timed_ask(node.spec.proxy_url, _body(i, i % 2 == 1, 200)))
            for i in range(8)]
    await prefills_answered(node, done + 4)
    assert node.proxy is not None
    _kill(node.proxy)
    # Each client is cut off (or was just answered): none is left hanging.
    ended = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), BOUND_S)
    assert all(isinstance(e, (aiohttp.ClientError, tuple)) for e in ended), ended
    # Every upstream connection of the proxy closed with it: vLLM aborts those requests,
    # and D's connector releases what P held for them; the rest P frees at send_timeout_s.
    await wait_no_blocks_held(node, within=45)
    await _restart(node.proxy)
    await in_rotation(node, "prefill")
    for i in range(2):
        await served_from_p(node, _body(i), expected[i])


async def test_prefill_killed_while_idle_and_restarted_costs_no_wait(node, plain_server,
                                                                       tmp_path):
    """P dies while D has no pull in flight; its restart binds new side-channel ports. D
    must not send the next pulls to the dead addresses (each would wait recv_timeout_s, then
    be recomputed on D): every request after the restart is served with P's KV, none much
    slower than before."""
    expected = await _expected(plain_server, range(30, 38))
    await in_rotation(node, "prefill")
    # An auto proxy beside the node's follows P's KV events: a restart drops what it knew
    # of P's cache and follows the new engine's events (new ports).
    auto, auto_url = second_proxy(node, tmp_path)
    auto.start()
    try:
        auto.wait_healthy(60)
        before = [await served_from_p(node, _body(i), expected[i]) for i in range(30, 34)]
        known = await _p_index(auto_url, node, lambda r: r["blocks"] > 0)
        _kill(node.prefill)
        await _restart(node.prefill)
        await in_rotation(node, "prefill", within=120)
        after = [await served_from_p(node, _body(i), expected[i]) for i in range(30, 38)]
        again = await _p_index(auto_url, node, lambda r: r["drops"] > known["drops"]
                               and r["verified"] > 0 and r["blocks"] > 0)
    finally:
        auto.stop()
    print(f"before the restart {max(before):.2f} s at most, after {max(after):.2f} s")
    assert max(after) < max(before) + 2, after
    assert again["usable"] and again["mismatched"] == 0, again
    await wait_no_blocks_held(node, within=60)


async def _p_index(url: str, node, check, within: float = 30) -> dict:
    """P's rank 0 in the proxy's prefix index once `check` holds."""
    deadline = time.monotonic() + within
    while True:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/status") as r:
                prefix = (await r.json())["prefix"]
        rank = prefix["nodes"].get(node.spec.prefill_url, {}).get("0")
        if rank is not None and check(rank):
            return rank
        assert time.monotonic() < deadline, f"P's index: {prefix}"
        await asyncio.sleep(0.3)


async def test_decode_killed_mid_stream(node, plain_server):
    """A stream that cannot go on elsewhere (a stop string keeps it off the first-token
    path: its chunks are the client's own, with no token ids; test_pd_migration.py has
    those that can) ends with an error event, and P holds nothing."""
    expected = await _expected(plain_server, range(1))
    body = {**_body(3, True, 400), "ignore_eos": True, "stop": ["\x00never\x00"]}
    lines: list[bytes] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.post(node.spec.proxy_url + "/v1/completions", json=body) as r:
            assert r.status == 200
            killed_at = None
            async for line in r.content:
                lines.append(line)
                if killed_at is None and sum(ln.startswith(b"data: {") for ln in lines) >= 3:
                    _kill(node.decode)
                    killed_at = time.monotonic()
            ended = time.monotonic()
    assert killed_at is not None and ended - killed_at < BOUND_S
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith(b"data: {")]
    assert "error" in events[-1]  # the stream said it failed, and ended
    print(f"P free {await _p_usage_zero(node, within=10):.1f} s after D was killed")
    # At once, not a hang: P answers it whole (the D it was sent to is gone), or a 503
    # once D is out of rotation.
    status, _, took = await timed_ask(node.spec.proxy_url, _body(0))
    assert took < BOUND_S
    await _restart(node.decode)
    await in_rotation(node, "decode", within=60)
    await served_from_p(node, _body(0), expected[0])  # a new D, the same P
    await wait_no_blocks_held(node, within=60)


async def test_decode_stalled_past_the_read_timeout(node, plain_server, tmp_path):
    """Only the read timeout can end it: this proxy does not count D as down. The whole
    answer gets its 504; the stream, led by P's token and silent from D since, goes on
    from P (exchange.migration) and is a plain server's."""
    expected = await _expected(plain_server, range(3))
    proxy, url = second_proxy(node, tmp_path, "--down-after-failures", "100000",
                              "--decode-read-timeout", "4")
    proxy.start()
    try:
        await asyncio.to_thread(proxy.wait_healthy, 60)
        pgid = node.decode.proc.pid
        os.killpg(pgid, signal.SIGSTOP)
        try:
            results = await asyncio.gather(timed_ask(url, _body(1)), timed_ask(url, _body(2, True)))
        finally:
            os.killpg(pgid, signal.SIGCONT)
        (whole, _, took_whole), (streamed, text, took_stream) = results
        assert whole == 504 and took_whole < BOUND_S
        assert (streamed, text) == (200, expected[2]) and took_stream < BOUND_S
        await wait_no_blocks_held(node, within=60)
        await in_rotation(node, "decode")
        status, text, _ = await timed_ask(url, _body(0))
        assert (status, text) == (200, expected[0])
    finally:
        proxy.stop()
