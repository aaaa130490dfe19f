"""Adaptive disaggregation with real vLLM: requests placed local (D alone) and remote (P,
then its KV to D) answer exactly as a plain server does, JSON and streams, completions and
chat; `never` leaves P untouched; `auto` is seeded before its first request (P's history,
or a calibration at start), then serves an idle node locally, and answers from D at once
while P is frozen. Two more proxies (split=never and split=auto, the default) in front of
the shared node's P and D."""

from __future__ import annotations

import json
import time
import urllib.request

import aiohttp
import pytest

from tests.e2e.conftest import (
    ask,
    log_text,
    openai_chat_stream,
    plain_request,
    proxies_in_front,
    text_of,
    token_prompt,
)
from tests.e2e.observe import metric, remote_decisions, timed_ask, wait_no_blocks_held
from tests.e2e.test_pd_frozen import BOUND_S, _freeze, _thaw

pytestmark = pytest.mark.slow

DECISIONS = "pd_proxy_split_decisions_total"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def proxies(pd_node, tmp_path_factory):
    """{"never": url, "auto": url} (auto with no flag: the proxy's default)."""
    with proxies_in_front(pd_node, tmp_path_factory, never=("--split", "never"),
                          auto=()) as out:
        _wait_seeded(out["auto"])  # its calibration, if any, is over before the tests
        yield out


def _completion(i: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": token_prompt(40 + 9 * i, seed=900 + i),
            "max_tokens": 8, "temperature": 0, "stream": stream}


async def _answers(url: str) -> list[str]:
    """The four kinds of request, one after another: completion JSON and stream, chat JSON
    and stream."""
    async with aiohttp.ClientSession() as http:
        json_status, json_text = await ask(http, url, _completion(0, False))
        stream_status, stream_text = await ask(http, url, _completion(1, True))
    assert (json_status, stream_status) == (200, 200), (json_text, stream_text)
    chat = text_of(await plain_request(url, "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}))
    chat_stream = "".join(await openai_chat_stream(url, MESSAGES, 8))
    return [json_text, stream_text, chat, chat_stream]


def _split_status(proxy: str) -> dict:
    with urllib.request.urlopen(proxy + "/status", timeout=10) as r:
        return json.load(r)["split"]


def _wait_quiet(proxy: str, within_s: float = 30.0) -> None:
    """Until the proxy reads no one else's requests on any engine: the gauges it reads each
    second (appliance.proxy.nodes.engineload) count the other proxies' last requests until
    its first reading after they end, and an engine busy with someone else's request is
    rightly not an idle one."""
    deadline = time.monotonic() + within_s
    while True:
        with urllib.request.urlopen(proxy + "/status", timeout=10) as r:
            status = json.load(r)
        others = [b["others"] for role in ("prefill", "decode") for b in status[role]]
        if all(o == {"waiting": 0, "running": 0} for o in others):
            return
        assert time.monotonic() < deadline, f"others' requests still read: {others}"
        time.sleep(0.2)


def _wait_seeded(proxy: str, within_s: float = 60.0) -> None:
    """Until the proxy's prefill line has a sample (appliance.proxy.placement.seeding)."""
    deadline = time.monotonic() + within_s
    while _split_status(proxy)["prefill"]["samples"] == 0:
        assert time.monotonic() < deadline, "auto was never seeded"
        time.sleep(0.2)


async def test_every_placement_answers_as_a_plain_server(pd_node, plain_server, proxies):
    expected = await _answers(plain_server)
    p, d = pd_node.spec.prefill_url, pd_node.spec.decode_url
    # never: D alone, P not asked at all (its prompt tokens do not move), no KV pulled.
    p_tokens = metric(p, "vllm:prompt_tokens_total")
    received = metric(d, "vllm:pd_kv_received_total")
    assert await _answers(proxies["never"]) == expected
    assert metric(p, "vllm:prompt_tokens_total") == p_tokens
    assert metric(d, "vllm:pd_kv_received_total") == received
    assert metric(proxies["never"], f'{DECISIONS}{{decision="local",reason="policy"}}') == 4
    # always (the node's own proxy): every request through P and its KV.
    assert await _answers(pd_node.spec.proxy_url) == expected
    # auto: P's prefills are timed before its first request (P's history from its metrics,
    # or a few short prompts if P has served none), so an idle D is sooner alone from the
    # first request on: nothing is placed `unmeasured`.
    auto = proxies["auto"]
    _wait_quiet(auto)  # the requests just sent through the other two proxies are over
    assert await _answers(auto) == expected
    assert metric(auto, f'{DECISIONS}{{reason="unmeasured"}}') == 0
    assert metric(auto, f'{DECISIONS}{{decision="local",reason="sooner"}}') == 4
    log = log_text(proxies["auto_log"])
    assert "split=local:sooner" in log and "unmeasured" not in log
    assert "auto: prefill" in log  # seeded from P's history, or calibrated
    split = _split_status(auto)
    assert split["policy"] == "auto" and split["last_minute"] == {"remote": 0, "local": 4,
                                                                          "p_alone": 0}
    assert split["prefill"]["samples"] >= 1
    await wait_no_blocks_held(pd_node, within=60)


async def test_a_frozen_p_costs_auto_nothing(pd_node, plain_server, proxies):
    """P answers nothing: auto's requests are placed on D alone and answered, exact, with
    no wait for P's health checks to find it down."""
    auto = proxies["auto"]
    if remote_decisions(auto) == 0:  # measured nothing yet (run alone): one request first
        await _answers(auto)
    bodies = [_completion(10 + i, i % 2 == 1) for i in range(4)]
    expected = [text_of(await plain_request(plain_server, "/v1/completions",
                                            {**b, "stream": False})) for b in bodies]
    remote = remote_decisions(auto)
    _freeze(pd_node.prefill)
    try:
        results = [await timed_ask(auto, b) for b in bodies]
    finally:
        _thaw(pd_node.prefill)
    print(f"P frozen, auto: answered within {max(r[2] for r in results):.2f} s")
    for (status, text, took), want in zip(results, expected, strict=True):
        assert (status, text) == (200, want)
        assert took < BOUND_S
    assert remote_decisions(auto) == remote  # none asked the frozen P
    await wait_no_blocks_held(pd_node, within=60)
