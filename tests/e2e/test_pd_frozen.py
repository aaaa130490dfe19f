"""A frozen node (SIGSTOP: it accepts connections and answers nothing), the failure SREs
meet most: the proxy finds it from its health checks within seconds and no client waits for
a timeout. P frozen: its requests go to D alone, with a plain server's output. D frozen:
its requests go on from P (exchange.migration), whole or after P's token, with a plain
server's output. Thawed, the node is back in rotation, serves from P's KV again, and
nothing stays held."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import pytest

from tests.e2e.conftest import log_text, plain_request, text_of, token_prompt
from tests.e2e.observe import in_rotation, metric, timed_ask, wait_no_blocks_held

pytestmark = pytest.mark.slow

BOUND_S = 15  # two failed health checks (0.5 s apart, 2 s timeout each), and the answer
PREFILL_DOWN = 'pd_proxy_prefill_fallbacks_total{reason="prefill_down"}'
# Prompt tokens D computed itself (not received as KV).
COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"


def _body(i: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": token_prompt(30 + 7 * i, seed=700 + i),
            "max_tokens": 6, "temperature": 0, "stream": stream}


def _freeze(svc) -> None:
    os.killpg(svc.proc.pid, signal.SIGSTOP)


def _thaw(svc) -> None:
    os.killpg(svc.proc.pid, signal.SIGCONT)


async def test_frozen_prefill_node_requests_go_to_decode_within_seconds(pd_node, plain_server):
    expected = [text_of(await plain_request(plain_server, "/v1/completions", _body(i)))
                for i in range(4)]
    _freeze(pd_node.prefill)
    try:
        results = await asyncio.gather(*(timed_ask(pd_node.spec.proxy_url, _body(i))
                                          for i in range(4)))
    finally:
        _thaw(pd_node.prefill)
    print(f"P frozen: answered within {max(r[2] for r in results):.1f} s")
    for (status, text, took), want in zip(results, expected, strict=True):
        assert status == 200, text
        assert text == want  # D alone: a plain prefill
        assert took < BOUND_S  # not the proxy's 120 s prefill timeout
    await in_rotation(pd_node, "prefill")
    got = await plain_request(pd_node.spec.proxy_url, "/v1/completions", _body(0))
    assert text_of(got) == expected[0]
    await wait_no_blocks_held(pd_node, within=60)


async def test_frozen_decode_node_requests_go_on_from_p_within_seconds(pd_node,
                                                                       plain_server):
    expected = {i: text_of(await plain_request(plain_server, "/v1/completions", _body(i)))
                for i in (5, 6, 7, 9)}
    _freeze(pd_node.decode)
    try:
        results = await asyncio.gather(*(timed_ask(pd_node.spec.proxy_url, _body(i, stream))
                                          for i, stream in ((5, False), (6, True), (7, True))))
    finally:
        _thaw(pd_node.decode)
    print(f"D frozen: answered within {max(r[2] for r in results):.1f} s")
    for i, (status, text, took) in zip((5, 6, 7), results, strict=True):
        assert took < BOUND_S, (status, text[:200])
        assert (status, text) == (200, expected[i])
    await in_rotation(pd_node, "decode")
    got = await plain_request(pd_node.spec.proxy_url, "/v1/completions", _body(9))
    assert text_of(got) == expected[9]
    await wait_no_blocks_held(pd_node, within=60)  # P's KV for the moved ones was released


async def test_frozen_prefill_node_costs_decodes_that_have_their_kv_nothing(pd_node,
                                                                           plain_server):
    """A whole answer says nothing until its decode ends, so its KV stays the proxy's
    (ASKED) all along: P frozen while 8 of them decode must not rerun them on D. D's own KV
    events told the proxy that D holds their blocks: each prompt computed once (on P), all
    answers a plain server's."""
    bodies = [{"model": "tiny", "prompt": token_prompt(320 + 16 * i, seed=800 + i),
               "max_tokens": 1600, "ignore_eos": True, "temperature": 0} for i in range(8)]
    expected = await asyncio.gather(*(plain_request(plain_server, "/v1/completions", b)
                                      for b in bodies))
    s = pd_node.spec
    # The proxy predicts nothing (so lands nothing on D) while no node holds a block: on a
    # node of its own (this test alone) one request first fills the index.
    await plain_request(s.proxy_url, "/v1/completions", {
        "model": "tiny", "prompt": token_prompt(96, seed=899), "max_tokens": 1})
    await _d_events_after_now(s.proxy_url, s.decode_url, batches=0)
    fallbacks = metric(s.proxy_url, PREFILL_DOWN)
    received = metric(s.decode_url, "vllm:pd_kv_received_total")
    computed = metric(s.decode_url, COMPUTED)
    tasks = [asyncio.create_task(timed_ask(s.proxy_url, b)) for b in bodies]
    for _ in range(300):  # every pull done: D decodes them all
        if metric(s.decode_url, "vllm:pd_kv_received_total") >= received + 8:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("D did not receive the 8 prompts' KV")
    await _d_events_after_now(s.proxy_url, s.decode_url)
    _freeze(pd_node.prefill)
    try:
        # Found down (down_after failed checks, not the first one, which only takes P out
        # of rotation) while they decode: about 4 s, against their 1,600 tokens.
        for _ in range(200):
            if "D holds the KV of its calls already" in log_text(pd_node.proxy.log_path) or \
                    metric(s.proxy_url, PREFILL_DOWN) != fallbacks:
                break
            assert not all(t.done() for t in tasks), "the decodes ended before P was down"
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the proxy never found P down")
        assert not all(t.done() for t in tasks), "the decodes ended before P was down"
        results = await asyncio.gather(*tasks)
    finally:
        _thaw(pd_node.prefill)
    for (status, text, _), want in zip(results, expected, strict=True):
        assert (status, text) == (200, text_of(want))
    assert metric(s.proxy_url, PREFILL_DOWN) == fallbacks  # none rerun on D alone
    assert "D holds the KV of its calls already" in log_text(pd_node.proxy.log_path)
    assert metric(s.decode_url, COMPUTED) - computed <= 8 * 32  # at most a block each
    await in_rotation(pd_node, "prefill")
    await wait_no_blocks_held(pd_node, within=60)


async def _d_events_after_now(proxy_url: str, d_url: str, batches: int = 2,
                              within: float = 30) -> None:
    """Wait until the proxy's index of D is usable, holds blocks, and has taken `batches`
    more of D's event batches (an idle D sends none): D caches pulled KV at its next step,
    and only its events tell the proxy that D holds it (an index of D forgotten by an
    earlier test must be re-synced first)."""
    def d_rank() -> dict:
        status = json.loads(urllib.request.urlopen(proxy_url + "/status").read())
        return status["prefix"]["nodes"].get(d_url, {}).get("0", {})
    start = d_rank().get("batches", 0)
    for _ in range(int(within * 10)):
        rank = d_rank()
        if rank.get("usable") and rank.get("batches", 0) >= start + batches and rank.get("blocks"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the proxy's index of D did not catch up: {d_rank()}")
