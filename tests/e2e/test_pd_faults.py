"""Injected faults (tests.faults: the connector's transport on P, the replies D receives)
at 1 in 16 on P's Mooncake writes (failed, or landed with junk in them) and on side-channel
replies, D checking every pull against P's digest, for a few hundred requests
through the proxy: every answer is a plain server's exact output or an error, never another
text; nothing is held afterwards; and a real Prometheus scraping the node fires the shipped
transfer-failure alert."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from appliance.localnode import NodeSpec
from tests.conftest import free_port
from tests.e2e.conftest import (
    TEST_CONNECTOR,
    ask,
    log_text,
    plain_request,
    running_node,
    token_prompt,
)
from tests.e2e.observe import wait_no_blocks_held
from tests.observability.conftest import (  # noqa: F401 (prometheus_bin: a fixture)
    prometheus_bin,
    running_prometheus,
)

pytestmark = pytest.mark.slow

PROMPTS = 24
REPEATS = 8  # 192 requests, half of them streamed
# P fails writes or lands junk, D drops replies
FAULTS = "write_fail=16,write_corrupt=16,reply_drop=16,seed=3"


def _body(i: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": token_prompt(16 + 23 * i, seed=400 + i), "max_tokens": 8,
            "temperature": 0, "stream": stream}


async def test_faults_one_in_16_give_exact_output_or_an_error(
        tiny_model, plain_server, tmp_path, prometheus_bin):  # noqa: F811
    expected = {}
    for i in range(PROMPTS):
        result = await plain_request(plain_server, "/v1/completions", _body(i, False))
        expected[i] = result["choices"][0]["text"]
    connector = {**TEST_CONNECTOR, "recv_timeout_s": 4, "verify_kv": "all"}
    # D waits for its KV as long as the proxy waits for P, plus the write's allowance
    # (appliance.deadlines): a dropped reply costs D that wait, so the proxy waits 6 s.
    proxy = (*NodeSpec.proxy_args, "--split", "always", "--prefill-timeout", "6")
    with running_node(tiny_model, tmp_path, proxy_port=free_port(), connector_extra=connector,
                      proxy_args=proxy,
                      prefill_faults=FAULTS, decode_faults=FAULTS) as node, \
            running_prometheus(prometheus_bin, tmp_path / "prometheus", {
                role: [url.removeprefix("http://")] for role, url in (
                    ("proxy", node.spec.proxy_url), ("prefill", node.spec.prefill_url),
                    ("decode", node.spec.decode_url))}) as prom:
        gate = asyncio.Semaphore(8)
        answers: list[tuple[int, int, str, float]] = []

        async def one(http: aiohttp.ClientSession, n: int) -> None:
            i = n % PROMPTS
            async with gate:
                started = time.monotonic()
                status, text = await ask(http, node.spec.proxy_url, _body(i, n % 2 == 1))
                answers.append((i, status, text, time.monotonic() - started))

        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.wait_for(asyncio.gather(
                *(one(http, n) for n in range(PROMPTS * REPEATS))), 900)
        assert len(answers) == PROMPTS * REPEATS
        wrong = [(i, text) for i, status, text, _ in answers
                 if status == 200 and text != expected[i]]
        assert wrong == []  # never another prompt's text, never a corrupted one
        errors = [a for a in answers if a[1] != 200]
        assert all(a[1] >= 400 for a in errors)
        assert max(a[3] for a in answers) < 60  # every one answered within the bound
        p_log, d_log = log_text(node.prefill.log_path), log_text(node.decode.log_path)
        assert "fault injection ON" in p_log and "fault injection ON" in d_log
        assert p_log.count("fault injection: a Mooncake write failed") >= 3
        assert d_log.count("fault injection: a side-channel reply dropped") >= 3
        # Each write that landed junk and answered ok was caught before D read it.
        corrupted = p_log.count("fault injection: a Mooncake write landed corrupted")
        caught = d_log.count("does not match what the producer wrote")
        assert corrupted >= 3 and caught >= max(2, corrupted * 2 // 3), (corrupted, caught)
        # and the faults cost answers nothing: D recomputed what it did not get
        assert len(errors) <= len(answers) // 20, errors[:3]
        await wait_no_blocks_held(node, within=60)
        # What an SRE's Prometheus, scraping all along, says of it: the shipped
        # transfer-failure alert fires (it resolves 5 minutes after the last failure:
        # alerts_test.yml checks that in virtual time).
        for _ in range(60):
            if prom.alerts().get("PDKVTransferFailures") == "firing":
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError(f"PDKVTransferFailures not firing: {prom.alerts()}")
