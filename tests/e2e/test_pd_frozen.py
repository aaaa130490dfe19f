"""A frozen node (SIGSTOP: it accepts connections and answers nothing), the failure SREs
meet most: the proxy finds it from its health checks within seconds and no client waits for
a timeout. P frozen: its requests go to D alone, with a plain server's output. D frozen:
its requests end with an error. Thawed, the node is back in rotation, serves from P's KV
again, and nothing stays held."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.e2e.conftest import plain_request, text_of, token_prompt
from tests.e2e.observe import in_rotation, timed_ask, wait_no_blocks_held

pytestmark = pytest.mark.slow

BOUND_S = 15  # two failed health checks (0.5 s apart, 2 s timeout each), and the answer


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


async def test_frozen_decode_node_requests_end_with_an_error_within_seconds(pd_node,
                                                                          plain_server):
    expected = text_of(await plain_request(plain_server, "/v1/completions", _body(9)))
    _freeze(pd_node.decode)
    try:
        results = await asyncio.gather(*(timed_ask(pd_node.spec.proxy_url, _body(i, stream))
                                          for i, stream in ((5, False), (6, True), (7, True))))
    finally:
        _thaw(pd_node.decode)
    print(f"D frozen: ended within {max(r[2] for r in results):.1f} s")
    for status, raw, took in results:
        assert took < BOUND_S, (status, raw[:200])
        assert status >= 500 or '"error"' in raw, (status, raw[:200])
    await in_rotation(pd_node, "decode")
    got = await plain_request(pd_node.spec.proxy_url, "/v1/completions", _body(9))
    assert text_of(got) == expected
    await wait_no_blocks_held(pd_node, within=60)  # P's KV for the failed ones was released
