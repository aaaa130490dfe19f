"""P frozen (SIGSTOP) or killed while its KV is on the way to D: P has answered, D waits for
the transfer. P's writes are slowed (tests.faults' connector, write_delay_ms) so that the
signal lands inside the transfer. The proxy finds P down from its health checks and asks D
again alone: every client gets a plain server's exact output well before D's
recv_timeout_s. Afterwards (P thawed, or restarted) P is back in rotation, the node serves
from P's KV again, and no block stays held."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.conftest import free_port
from tests.e2e.conftest import (
    TEST_CONNECTOR,
    plain_request,
    running_node,
    text_of,
    token_prompt,
)
from tests.e2e.observe import (
    in_rotation,
    metric,
    prefills_answered,
    served_from_p,
    timed_ask,
    wait_no_blocks_held,
)

pytestmark = pytest.mark.slow

DELAY_MS = 3000  # every Mooncake write of P starts this late
RECV_TIMEOUT_S = 25  # D's own deadline for a transfer
BOUND_S = 15  # P's answer, two failed health checks (0.5 s apart), D alone: well under it

PREFILL_DOWN = 'pd_proxy_prefill_fallbacks_total{reason="prefill_down"}'


@pytest.fixture(scope="module")
def slow_link_node(tiny_model, tmp_path_factory):
    connector = {**TEST_CONNECTOR, "recv_timeout_s": RECV_TIMEOUT_S, "send_timeout_s": 60}
    with running_node(tiny_model, tmp_path_factory.mktemp("mid-transfer"),
                      proxy_port=free_port(), connector_extra=connector,
                      prefill_faults=f"write_delay_ms={DELAY_MS}") as node:
        yield node


def _body(i: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": token_prompt(40 + 9 * i, seed=900 + i),
            "max_tokens": 6, "temperature": 0, "stream": stream}


async def _during_transfers(node, plain_server, signal_p) -> None:
    wanted = [(i, stream) for i in range(4) for stream in (False, True)]
    expected = {i: text_of(await plain_request(plain_server, "/v1/completions", _body(i)))
                for i in range(4)}
    done = metric(node.spec.proxy_url, "pd_proxy_prefill_seconds_count")
    asks = [asyncio.create_task(timed_ask(node.spec.proxy_url, _body(i, s))) for i, s in wanted]
    await prefills_answered(node, done + len(wanted))
    fallbacks = metric(node.spec.proxy_url, PREFILL_DOWN)
    signal_p()
    signalled = time.monotonic()
    results = await asyncio.gather(*asks)
    print(f"all {len(wanted)} answered {time.monotonic() - signalled:.1f} s after the signal")
    for (i, _), (status, text, took) in zip(wanted, results, strict=True):
        assert status == 200, text[:300]
        assert text == expected[i]
        assert took < BOUND_S, took  # not D's recv_timeout_s
    moved = metric(node.spec.proxy_url, PREFILL_DOWN)
    assert moved - fallbacks >= 1  # the waiting D calls were asked again, alone


async def _served_from_p_again(node, plain_server) -> None:
    await in_rotation(node, "prefill", within=120)
    want = text_of(await plain_request(plain_server, "/v1/completions", _body(7)))
    await served_from_p(node, _body(7), want, BOUND_S)


async def test_p_frozen_during_transfers(slow_link_node, plain_server):
    node = slow_link_node
    pgid = node.prefill.proc.pid
    try:
        await _during_transfers(node, plain_server, lambda: os.killpg(pgid, signal.SIGSTOP))
    finally:
        os.killpg(pgid, signal.SIGCONT)
    # Thawed, P answers the cancels of the abandoned transfers: D frees their blocks.
    await wait_no_blocks_held(node, within=RECV_TIMEOUT_S + 30)
    await _served_from_p_again(node, plain_server)


async def test_p_killed_during_transfers_and_restarted(slow_link_node, plain_server):
    node = slow_link_node
    pgid = node.prefill.proc.pid

    def kill() -> None:
        os.killpg(pgid, signal.SIGKILL)

    await _during_transfers(node, plain_server, kill)
    node.prefill.proc.wait(10)
    # D alone meanwhile: new requests are answered at once, exactly.
    want = text_of(await plain_request(plain_server, "/v1/completions", _body(5)))
    status, text, took = await timed_ask(node.spec.proxy_url, _body(5))
    assert (status, text) == (200, want) and took < BOUND_S
    node.prefill.start()  # same engine id, new process: D must not trust the old one's state
    await asyncio.to_thread(node.prefill.wait_healthy, 300)
    await _served_from_p_again(node, plain_server)
    await wait_no_blocks_held(node, within=RECV_TIMEOUT_S + 30)
