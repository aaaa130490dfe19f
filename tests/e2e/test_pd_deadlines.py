"""One deadline policy (appliance.deadlines) with real vLLM: P backed up (the connector's
fault seam holds new prefills in P's queue), behind a proxy that waits PREFILL_WAIT_S for
P. D is configured to wait 8 s for KV (TEST_CONNECTOR), less than the proxy waits: the
request's own deadline, which the proxy sends, rules it. A P that starts late is still
pulled from (before, D recomputed at 8 s while P computed the prompt too), and a P that does
not start within the proxy's wait never computes the prompt: the proxy closes its call (vLLM
drops the queued request) and D alone answers. Each prompt computed once, in one place, and
every answer a plain server's."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.conftest import (
    TEST_CONNECTOR,
    hold_prefills,
    plain_request,
    second_proxy,
    text_of,
    token_prompt,
)
from tests.e2e.observe import metric, timed_ask, wait_no_blocks_held

pytestmark = pytest.mark.slow

PREFILL_WAIT_S = 12
COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"
RECEIVED = "vllm:pd_kv_received_total"
TIMED_OUT = 'pd_proxy_prefill_fallbacks_total{reason="prefill_timeout"}'


def _bodies(seed: int) -> list[dict]:
    # Non-streaming requests ask P and D at once (D's deadline is the whole wait); streams
    # ask D once P answered (P's token first).
    return [{"model": "tiny", "prompt": token_prompt(90 + 37 * i, seed=seed + i),
             "max_tokens": 6, "temperature": 0, "stream": i % 2 == 1} for i in range(4)]


@pytest.fixture(scope="module")
def proxy(pd_node, tmp_path_factory):
    svc, url = second_proxy(pd_node, tmp_path_factory.mktemp("deadline-proxy"),
                            "--split", "always", "--prefill-timeout", str(PREFILL_WAIT_S))
    svc.start()
    try:
        svc.wait_healthy(60)
        yield url
    finally:
        svc.stop()


async def _counters(pd_node) -> tuple[float, float, float]:
    s = pd_node.spec
    return metric(s.prefill_url, COMPUTED), metric(s.decode_url, COMPUTED), \
        metric(s.decode_url, RECEIVED)


async def _wave(pd_node, proxy: str, plain_server, seed: int, hold_s: float):
    bodies = _bodies(seed)
    expected = [text_of(await plain_request(plain_server, "/v1/completions",
                                            {**b, "stream": False})) for b in bodies]
    before = await _counters(pd_node)
    with hold_prefills(pd_node):
        asks = [asyncio.create_task(timed_ask(proxy, b)) for b in bodies]
        await asyncio.sleep(hold_s)
    results = await asyncio.gather(*asks)
    for (status, text, _), want in zip(results, expected, strict=True):
        assert (status, text) == (200, want)
    await asyncio.sleep(1.5)  # P's and D's counters reach /metrics with their next steps
    after = await _counters(pd_node)
    moved = [a - b for a, b in zip(after, before, strict=True)]
    return sum(len(b["prompt"]) for b in bodies), moved, [took for _, _, took in results]


async def test_a_p_that_starts_late_but_within_the_proxys_wait_is_pulled_from(
        pd_node, proxy, plain_server):
    assert TEST_CONNECTOR["recv_timeout_s"] < 9.5 < PREFILL_WAIT_S
    tokens, (on_p, on_d, received), took = await _wave(pd_node, proxy, plain_server,
                                                       seed=1300, hold_s=9.5)
    print(f"P held 9.5 s: answered in {min(took):.1f}-{max(took):.1f} s; computed on P "
          f"{on_p:.0f}, on D {on_d:.0f} of {tokens} prompt tokens; {received:.0f} pulls")
    assert on_p == tokens  # every prompt computed on P...
    assert received == 4  # ...its KV pulled by D...
    assert on_d <= 4 * 32  # ...which did not compute it again (at most a block each)
    await wait_no_blocks_held(pd_node, within=60)


async def test_a_p_that_does_not_start_within_the_proxys_wait_computes_nothing(
        pd_node, proxy, plain_server):
    timed_out = metric(proxy, TIMED_OUT)
    started = time.monotonic()
    tokens, (on_p, on_d, received), took = await _wave(pd_node, proxy, plain_server,
                                                       seed=1400, hold_s=PREFILL_WAIT_S + 3)
    print(f"P held {PREFILL_WAIT_S + 3} s: answered in {min(took):.1f}-{max(took):.1f} s; "
          f"computed on P {on_p:.0f}, on D {on_d:.0f} of {tokens} prompt tokens")
    assert metric(proxy, TIMED_OUT) - timed_out == 4
    assert max(took) < PREFILL_WAIT_S + 5  # the proxy's wait, then D alone: not D's deadline
    assert on_p == 0  # dropped from P's queue, never computed...
    assert on_d == tokens and received == 0  # ...and computed once, on D
    assert time.monotonic() - started < 60
    await wait_no_blocks_held(pd_node, within=60)
