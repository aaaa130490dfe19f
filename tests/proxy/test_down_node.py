"""A node that stops answering (a frozen process accepts connections and says nothing) is
found by the health checks within seconds, and the calls it holds fail then, not at their
timeouts: P's go to D alone, D's go on from another engine (P) or end with an error."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.proxy.conftest import MakeCluster

SLOW = {"prefill_timeout_s": 60.0, "decode_read_timeout_s": 60.0}


async def test_a_hung_prefill_node_fails_over_to_decode_within_seconds(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(**SLOW)
    p = c.prefill[0]
    p.hang = True
    task = asyncio.create_task(c.post())
    await p.wait_requests(1)
    started = time.monotonic()
    p.healthy = False  # its health checks fail from now on, as a frozen node's time out
    status, _body, _ = await asyncio.wait_for(task, 10)
    assert status == 200  # served by D alone
    assert time.monotonic() - started < 3  # not the 60 s prefill timeout
    metrics = await (await c.http.get(f"{c.url}/metrics")).text()
    assert 'kind="down"' in metrics


@pytest.mark.parametrize("limit", [0, 1])
async def test_a_hung_decode_node_ends_its_stream_within_seconds(
        make_cluster: MakeCluster, limit: int) -> None:
    """D hangs after its stream's headers and is found down: with no migration, the stream
    ends with an error event saying so; by default P answers it whole in the same stream
    (none of D's events reached the client)."""
    c = await make_cluster(migration_limit=limit, **SLOW)
    d = c.decode[0]
    d.hang_after_headers = True
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
    task = asyncio.create_task(c.post(body=body))
    await d.wait_requests(1)
    await asyncio.sleep(0.2)
    started = time.monotonic()
    d.healthy = False
    status, answer, _ = await asyncio.wait_for(task, 10)
    assert time.monotonic() - started < 3
    if limit == 0:
        assert status >= 500 or "error" in str(answer)  # an error status or an SSE error event
        assert "is down" in str(answer) and "did not answer" not in str(answer)
        return
    assert status == 200 and "error" not in str(answer) and str(answer).endswith("[DONE]\n\n")
    whole = c.prefill[0].bodies()[-1]
    assert "kv_transfer_params" not in whole and whole["prompt"] == "hello"
    metrics = await (await c.http.get(f"{c.url}/metrics")).text()
    assert 'pd_proxy_migrations_total{how="whole"} 1.0' in metrics


@pytest.mark.parametrize("limit", [0, 1])
async def test_a_call_on_a_decode_node_found_down_says_so(make_cluster: MakeCluster,
                                                          limit: int) -> None:
    """Not "did not answer in 300 s" after a few seconds: the node was found down. By
    default P answers it whole instead."""
    c = await make_cluster(migration_limit=limit, **SLOW)
    d = c.decode[0]
    d.hang = True
    task = asyncio.create_task(c.post())
    await d.wait_requests(1)
    d.healthy = False
    status, answer, _ = await asyncio.wait_for(task, 10)
    metrics = await (await c.http.get(f"{c.url}/metrics")).text()
    # Counted once for the node's calls, not again per call.
    assert f'pd_proxy_upstream_errors_total{{backend="{d.url}",kind="down",role="decode"}} 1.0' \
        in metrics
    if limit:
        assert status == 200 and answer["choices"], answer
        assert 'pd_proxy_migrations_total{how="whole"} 1.0' in metrics
        return
    assert status == 502, answer
    message = answer["error"]["message"]
    assert message.startswith(f"decode node {d.url} is down"), message


async def test_one_failed_check_does_not_fail_what_the_node_holds(
        make_cluster: MakeCluster) -> None:
    """A single slow or failed health check (a busy node) takes the node out of rotation
    but leaves its calls alone: only down_after_failures in a row count as down."""
    c = await make_cluster(down_after_failures=1000, **SLOW)
    d = c.decode[0]
    d.delay = 1.0
    task = asyncio.create_task(c.post())
    await d.wait_requests(1)
    d.healthy = False
    await asyncio.sleep(0.3)
    d.healthy = True
    status, _, _ = await asyncio.wait_for(task, 10)
    assert status == 200


@pytest.mark.parametrize("split", ["never", "always"])
async def test_a_request_whose_decode_node_is_found_down_before_any_byte_goes_to_another(
        make_cluster: MakeCluster, split: str) -> None:
    """A rollout's old D can take a request as it stops, and hold it unanswered until the
    health checks find it down: nothing reached the client, so another D serves it alone
    (a remote request's KV on P is given up), not a 502."""
    c = await make_cluster(n_decode=2, split=split, **SLOW)
    for d in c.decode:
        d.hang = True
    task = asyncio.create_task(c.post())
    for _ in range(500):
        took = [d for d in c.decode if d.received]
        if took:
            break
        await asyncio.sleep(0.01)
    (gone,) = took
    (other,) = [d for d in c.decode if d is not gone]
    other.hang = False
    gone.healthy = False
    status, answer, _ = await asyncio.wait_for(task, 10)
    assert status == 200, answer
    (asked,) = other.bodies()
    assert "kv_transfer_params" not in asked  # alone: its own prefill
    metrics = await c.metrics()
    assert 'pd_proxy_prefill_fallbacks_total{reason="decode_down"} 1.0' in metrics
    if split == "always":
        (p_call,) = c.prefill[0].received
        xfer = p_call.kv["transfer_id"]
        await c.wait_for(lambda: xfer in c.released())  # what P held is freed at once


async def test_with_no_other_decode_node_the_request_still_ends_at_once(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="never", migration_limit=0, **SLOW)
    c.decode[0].hang = True
    task = asyncio.create_task(c.post())
    await c.decode[0].wait_requests(1)
    c.decode[0].healthy = False
    status, answer, _ = await asyncio.wait_for(task, 10)
    assert status == 502 and "is down" in answer["error"]["message"]


@pytest.mark.parametrize("split", ["always", "never"])
async def test_a_decode_node_killed_mid_whole_answer_p_answers_it(make_cluster: MakeCluster,
                                                                 split: str) -> None:
    """D's connection closes before its whole answer came: nothing reached the client, so
    P (the only other engine) answers the request whole."""
    c = await make_cluster(split=split)
    c.decode[0].die_after = 0
    status, answer, _ = await c.post()
    assert status == 200 and answer["choices"][0]["text"] == "t0 t1 t2 t3", answer
    whole = c.prefill[0].bodies()[-1]
    assert "kv_transfer_params" not in whole and whole["max_tokens"] != 1
    metrics = await (await c.http.get(f"{c.url}/metrics")).text()
    assert 'pd_proxy_migrations_total{how="whole"} 1.0' in metrics
