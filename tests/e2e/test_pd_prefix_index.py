"""The proxy's prefix index against real engines: P's and D's own KV events, followed by an
auto proxy in front of the shared node. What it predicts cached on each node, request by
request, is what that engine's prefix cache then hits (vllm:prefix_cache_hits); the access
line shows it; under pressure P evicts and the index follows."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import aiohttp
import pytest

from tests.e2e.conftest import ask, log_text, second_proxy, token_prompt
from tests.e2e.observe import metric

pytestmark = pytest.mark.slow

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PREDICTED = "pd_proxy_prefix_predicted_hits_total"


@pytest.fixture(scope="module")
def auto(pd_node, tmp_path_factory):
    svc, url = second_proxy(pd_node, tmp_path_factory.mktemp("proxy-prefix"),
                            "--tokenizer", str(pd_node.spec.model))
    svc.start()
    try:
        svc.wait_healthy(60)
        yield url, svc.log_path
    finally:
        svc.stop()


def _status(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/status", timeout=10).read())


async def _settled(url: str, nodes: tuple[str, ...], within: float = 20,
                   busy: bool = False) -> dict:
    """The index once every node is followed and no batch came for a moment (the events
    of the last request are in). `busy`: decodes publish a batch every few steps, so wait
    a moment instead (a request's own events come within milliseconds of its end)."""
    deadline = time.monotonic() + within
    last = None
    while True:
        index = (_status(url)["prefix"] or {}).get("nodes", {})
        seen = {n: sum(r["batches"] for r in index.get(n, {}).values()) for n in nodes}
        if all(n in index for n in nodes) and (busy or seen == last):
            if busy:
                await asyncio.sleep(0.5)
            return index
        assert time.monotonic() < deadline, f"index not settled: {index}"
        last = seen
        await asyncio.sleep(0.3)


def _predicted(url: str, node: str) -> float:
    """The proxy's predicted hits on one node (its series carry role and backend)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(PREDICTED) and f'backend="{node}"' in line)


async def test_predicted_hits_are_the_engines_hits(pd_node, auto):
    url, log_path = auto
    p, d = pd_node.spec.prefill_url, pd_node.spec.decode_url
    await _settled(url, (p, d))
    base = token_prompt(300, seed=4242)
    chat = [{"role": "user", "content": "Tell me about the sea and the ships on it. " * 8}]
    bodies = [
        {"prompt": base}, {"prompt": base},  # the same prompt again: all but the last block
        {"prompt": base + token_prompt(90, seed=4243)},  # one that extends it
        {"prompt": "the block cache holds tokens " * 30},
        {"prompt": "the block cache holds tokens " * 30 + "and more of them " * 10},
    ]
    before = {n: (metric(n, HITS), _predicted(url, n)) for n in (p, d)}
    async with aiohttp.ClientSession() as http:
        # Long decodes on D meanwhile (each within P's max_model_len: auto may ask P first),
        # so that auto places some prompts on P too.
        done = asyncio.Event()

        async def decoding() -> None:
            while not done.is_set():
                await ask(http, url, {"model": "tiny", "prompt": token_prompt(20, seed=1),
                                      "max_tokens": 900, "ignore_eos": True, "stream": True})
        background = asyncio.create_task(decoding())
        await asyncio.sleep(0.5)
        for body in bodies:
            status, text = await ask(http, url, {"model": "tiny", "max_tokens": 4,
                                                 "temperature": 0, **body})
            assert status == 200, text
            await _settled(url, (p, d), busy=True)
        for turn in range(3):  # a conversation whose every turn holds the last
            async with http.post(url + "/v1/chat/completions", json={
                    "model": "tiny", "messages": chat, "max_tokens": 6,
                    "temperature": 0}) as r:
                answer = await r.json()
            assert r.status == 200, answer
            chat += [{"role": "assistant",
                      "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And turn {turn}, tell me more of it. " * 4}]
            await _settled(url, (p, d), busy=True)
        done.set()
        await background
    got = {n: (metric(n, HITS) - before[n][0], _predicted(url, n) - before[n][1])
           for n in (p, d)}
    print("engine hits vs predicted, per node:", got)
    assert all(h > 0 for h, _ in got.values())  # the workload does hit, on both
    for node, (hits, predicted) in got.items():
        assert predicted == hits, (node, got)
    # The access line: P's and D's cached tokens of the prompt's, and the tokenize's time.
    assert re.search(r" cached=\d+/\d+/\d+ tokenize_ms=[\d.]+ ", log_text(log_path))
    index = await _settled(url, (p, d))
    assert all(r["usable"] and r["mismatched"] == 0 and r["verified"] > 0
               for n in (p, d) for r in index[n].values()), index
    # The proxy tokenized the text prompts in process, and checked each (the first of each
    # kind are) against D's /tokenize: the same ids.
    tokenizer = _status(url)["prefix"]["tokenizer"]
    assert tokenizer == {"where": "proxy", "checked": {"completion": 2, "chat": 3}}, tokenizer


async def test_a_burst_on_one_prefix_is_predicted(pd_node, auto):
    """Requests sharing a new prefix, sent at once: each after the first is placed before
    any event of the first came, yet the engine serves it from the blocks the first is
    computing. The index counts those blocks where the first is computed, so what it
    predicts is still what the engines hit, and the burst's later requests show it."""
    url, log_path = auto
    p, d = pd_node.spec.prefill_url, pd_node.spec.decode_url
    await _settled(url, (p, d))
    prefix = token_prompt(256, seed=5_150_001)
    before = {n: (metric(n, HITS), _predicted(url, n)) for n in (p, d)}
    seen = len(re.findall(r" cached=", log_text(log_path)))
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(
            ask(http, url, {"model": "tiny", "max_tokens": 2, "temperature": 0,
                            "prompt": prefix + token_prompt(40, seed=5_150_010 + i)})
            for i in range(4)))
    assert all(status == 200 for status, _ in answers), answers
    await _settled(url, (p, d))
    got = {n: (metric(n, HITS) - before[n][0], _predicted(url, n) - before[n][1])
           for n in (p, d)}
    print("burst: engine hits vs predicted, per node:", got)
    # Wherever each went (D alone, P alone, or split), some were served from the blocks of
    # one placed before them.
    assert sum(h for h, _ in got.values()) >= 256
    for node, (hits, predicted) in got.items():
        assert predicted == hits, (node, got)
    cached = re.findall(r" cached=(\d+)/(\d+)/\d+", log_text(log_path))[seen:]
    assert any(max(int(cp), int(cd)) >= 256 for cp, cd in cached), cached


async def test_a_burst_on_shared_prefixes_computes_each_prefix_once(pd_node):
    """Four prompts on two new prefixes, sent at once to D, which chunks its prefills
    (decode_prefill_chunk): a prompt whose prefix another one is computing waits for it
    (appliance.connector.prefixwait), so D computes each prefix once, as a server that does
    not chunk would. Without the wait, vLLM lets the later prompt compute the chunks not yet
    scheduled itself, and both compute the prefix."""
    d = pd_node.spec.decode_url
    prefixes = [token_prompt(512, seed=5_160_001 + k) for k in range(2)]
    before = metric(d, QUERIES) - metric(d, HITS)
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(
            ask(http, d, {"model": "tiny", "max_tokens": 4, "temperature": 0,
                          "prompt": prefixes[i % 2] + token_prompt(40, seed=5_160_010 + i)})
            for i in range(4)))
    assert all(status == 200 for status, _ in answers), answers
    computed = metric(d, QUERIES) - metric(d, HITS) - before
    assert computed == 2 * (512 + 40) + 2 * 40, computed


async def test_evictions_under_pressure_are_followed(pd_node, auto):
    """D's cache overflows (distinct prompts sent to D directly): the first prompt's blocks
    are evicted, and the index predicts no more of them than D then hits. D looks its cache
    up whether the proxy places the prompt local or remote."""
    url, _ = auto
    d = pd_node.spec.decode_url
    # Seeds no other test uses: the node is shared, and a prompt of another test's seed
    # begins with the same tokens (D holding it would pull nothing of P's KV for it).
    first = token_prompt(960, seed=1_000_077)
    async with aiohttp.ClientSession() as http:
        async def one(prompt: list[int]) -> None:
            status, text = await ask(http, d, {"model": "tiny", "prompt": prompt,
                                               "max_tokens": 1})
            assert status == 200, text
        await one(first)
        index = await _settled(url, (d,))
        blocks = index[d]["0"]["blocks"]
        assert blocks >= 960 // 32
        for start in range(0, 200, 4):  # well past D's KV (about 4,096 blocks of 32)
            await asyncio.gather(*(one(token_prompt(960, seed=1_001_000 + i))
                                   for i in range(start, start + 4)))
            index = await _settled(url, (d,))
            if index[d]["0"]["blocks"] < blocks + (start + 4) * 30:
                break  # evicting
        else:
            pytest.fail(f"D never evicted: {index}")
    print(f"D evicting after {start + 4} prompts: {index[d]}")
    hits, predicted = metric(d, HITS), _predicted(url, d)
    async with aiohttp.ClientSession() as http:
        status, text = await ask(http, url, {"model": "tiny", "prompt": first,
                                             "max_tokens": 2, "temperature": 0})
    assert status == 200, text
    await _settled(url, (d,))
    assert _predicted(url, d) - predicted == metric(d, HITS) - hits
