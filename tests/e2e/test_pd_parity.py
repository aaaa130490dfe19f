"""The proof that matters most: greedy output through P→D equals one plain vLLM server's,
token for token, and D really used P's KV."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from tests.e2e.conftest import log_text, pd_request, plain_request, text_of, token_prompt
from tests.e2e.observe import kv_usage, metric, wait_no_blocks_held

pytestmark = pytest.mark.slow

BLOCK = 32
# Shorter than one block, exactly N blocks, N blocks + a few tokens, several hundred tokens.
LENGTHS = [5, 2 * BLOCK, 2 * BLOCK + 3, 450]


def completion(prompt, max_tokens=24, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}


def tokens_of(result: dict) -> list[int]:
    return result["choices"][0]["token_ids"]


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "amx_tile" in fh.read().split()
    except OSError:
        return False


@pytest.mark.skipif(not cpu_has_amx(), reason="needs a CPU with AMX (amx_tile in /proc/cpuinfo)")
async def test_amx_host_decode_survives_prompts_it_never_computed(pd_node, plain_server):
    """On AMX CPUs vLLM's CPU attention runs its AMX kernel for bf16, and a process must
    ask Linux for AMX first. D's first forward is one token over P's KV, so nothing had
    asked before it: without the worker's request D dies with SIGILL right here."""
    for length in (5, 40, 64):
        body = completion(token_prompt(length, seed=900 + length), max_tokens=4)
        expected = await plain_request(plain_server, "/v1/completions", body)
        got, _ = await pd_request(pd_node, "/v1/completions", body)
        assert tokens_of(got) == tokens_of(expected)
    for service in (pd_node.prefill, pd_node.decode):
        assert "AMX in use" in log_text(service.log_path)
    assert "died unexpectedly" not in log_text(pd_node.decode.log_path)


@pytest.mark.parametrize("length", LENGTHS)
async def test_completions_equal_plain_server(pd_node, plain_server, length):
    body = completion(token_prompt(length, seed=length))
    expected = await plain_request(plain_server, "/v1/completions", body)
    got, p_result = await pd_request(pd_node, "/v1/completions", body)
    assert tokens_of(got) == tokens_of(expected)
    assert text_of(got) == text_of(expected)
    assert p_result["usage"]["completion_tokens"] == 1


async def test_chat_equals_plain_server(pd_node, plain_server):
    body = {"model": "tiny", "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "system", "content": "You answer in one line."},
                         {"role": "user", "content": "Name three rivers and a mountain."}]}
    expected = await plain_request(plain_server, "/v1/chat/completions", body)
    got, _ = await pd_request(pd_node, "/v1/chat/completions", body)
    assert text_of(got) == text_of(expected) and text_of(got)


async def test_concurrent_requests_equal_plain_server(pd_node, plain_server):
    bodies = [completion(token_prompt(40 + 61 * i, seed=100 + i), max_tokens=12)
              for i in range(6)]
    expected = [await plain_request(plain_server, "/v1/completions", b) for b in bodies]
    got = await asyncio.gather(*(pd_request(pd_node, "/v1/completions", b) for b in bodies))
    assert [tokens_of(g) for g, _ in got] == [tokens_of(e) for e in expected]


async def test_decode_really_uses_prefill_kv(pd_node, plain_server):
    """Control: give D prompt B but P prompt A (same length, same last token). D recomputes
    only B's last token against P's KV, so its answer follows A, not B."""
    a = token_prompt(100, seed=7)
    b = token_prompt(100, seed=8)
    b[-1] = a[-1]
    plain_a = await plain_request(plain_server, "/v1/completions", completion(a))
    plain_b = await plain_request(plain_server, "/v1/completions", completion(b))
    assert tokens_of(plain_a) != tokens_of(plain_b)
    got, _ = await pd_request(pd_node, "/v1/completions", completion(b),
                              p_body=completion(a))
    assert tokens_of(got) == tokens_of(plain_a)


async def test_kv_sent_when_prefill_token_is_a_stop_token(pd_node, plain_server):
    """P's single token ends the request with FINISHED_STOPPED (vllm#46008): the KV must
    still be sent, not left for D to wait on."""
    body = completion(token_prompt(70, seed=11), max_tokens=10)
    expected = await plain_request(plain_server, "/v1/completions", body)
    first = tokens_of(expected)[0]
    start = time.monotonic()
    got, p_result = await pd_request(pd_node, "/v1/completions", body,
                                     p_extra={"stop_token_ids": [first]})
    assert p_result["choices"][0]["finish_reason"] == "stop"
    assert tokens_of(got) == tokens_of(expected)
    assert time.monotonic() - start < 6  # well inside the 8 s receive deadline
    transfer_id = None
    for line in log_text(pd_node.decode.log_path).splitlines():
        if "received d_req=" in line:
            transfer_id = re.search(r"transfer=(\S+)", line).group(1)
    assert transfer_id is not None


async def test_missing_prefill_falls_back_within_the_deadline(pd_node, plain_server):
    """No P request ever arrives: D gives up at its receive deadline and vLLM recomputes the
    prompt locally (kv_load_failure_policy=recompute): an answer, not a hang."""
    body = completion(token_prompt(90, seed=21), max_tokens=8)
    expected = await plain_request(plain_server, "/v1/completions", body)
    start = time.monotonic()
    got, _ = await pd_request(pd_node, "/v1/completions", body, send_p=False)
    elapsed = time.monotonic() - start
    assert tokens_of(got) == tokens_of(expected)
    assert 7 < elapsed < 30


async def test_decode_client_abort_releases_blocks(pd_node):
    """A client that gives up while D waits for KV: D's request is aborted, D tells P, and
    D's blocks are freed well before the receive deadline (no leak, dynamo#7489)."""
    body = completion(token_prompt(300, seed=31), max_tokens=8)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(pd_request(pd_node, "/v1/completions", body, send_p=False), 1.5)
    start = time.monotonic()
    while kv_usage(pd_node.spec.decode_url) > 0:
        assert time.monotonic() - start < 6, "aborted request still holds D's blocks"
        await asyncio.sleep(0.2)


async def test_z_transfer_metrics_exported(pd_node):
    """The connector's stats reach each server's Prometheus /metrics."""
    deadline = time.monotonic() + 30
    while True:
        sent = metric(pd_node.spec.prefill_url, "vllm:pd_kv_transfers_total")
        received = metric(pd_node.spec.decode_url, "vllm:pd_kv_received_total")
        failed = metric(pd_node.spec.decode_url, "vllm:pd_kv_failed_receives_total")
        if sent >= 10 and received >= 10 and failed >= 1:
            break
        assert time.monotonic() < deadline, (sent, received, failed)
        await asyncio.sleep(1)
    assert metric(pd_node.spec.prefill_url, "vllm:pd_kv_transfer_bytes_total") > 0


async def test_zz_no_blocks_left_held(pd_node):
    """After every test above: neither side holds KV blocks (no leak on any path)."""
    await wait_no_blocks_held(pd_node)


def _pulled_blocks(node, transfer_id: str) -> int:
    """Blocks D pulled for a transfer, from its 'received' log line."""
    for line in log_text(node.decode.log_path).splitlines():
        if f"transfer={transfer_id} " in line and "received d_req=" in line:
            return int(re.search(r"blocks=(\d+)", line).group(1))
    raise AssertionError(f"no received line for {transfer_id}")


async def test_a_conversations_next_turn_pulls_only_what_d_lacks(pd_node, plain_server):
    """D keeps the KV it received and the tokens it decoded in its prefix cache: the next
    turn, whose prompt is the last one plus the answer plus a new message, pulls from P only
    the blocks past D's prefix hit. Both answers are a plain server's."""
    turn1 = token_prompt(200, seed=41)
    body1 = completion(turn1, max_tokens=40)
    want1 = tokens_of(await plain_request(plain_server, "/v1/completions", body1))
    got1, _ = await pd_request(pd_node, "/v1/completions", body1, transfer_id="xfer-turn-1")
    assert tokens_of(got1) == want1
    turn2 = turn1 + want1 + token_prompt(60, seed=42)
    body2 = completion(turn2, max_tokens=8)
    want2 = tokens_of(await plain_request(plain_server, "/v1/completions", body2))
    hits = metric(pd_node.spec.decode_url, "vllm:prefix_cache_hits_total")
    got2, _ = await pd_request(pd_node, "/v1/completions", body2, transfer_id="xfer-turn-2")
    assert tokens_of(got2) == want2
    assert _pulled_blocks(pd_node, "xfer-turn-1") == -(-len(turn1) // BLOCK)  # all 7
    # Turn 1's 239 computed tokens fill 7 blocks on D: of turn 2's 10, 3 come from P.
    cached = (len(turn1) + len(want1) - 1) // BLOCK
    assert _pulled_blocks(pd_node, "xfer-turn-2") == -(-len(turn2) // BLOCK) - cached
    assert metric(pd_node.spec.decode_url, "vllm:prefix_cache_hits_total") - hits \
        == cached * BLOCK
    await wait_no_blocks_held(pd_node, within=60)
