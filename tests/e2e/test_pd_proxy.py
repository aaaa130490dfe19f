"""The whole request path as users meet it: client → proxy :8000 → P and D (real vLLM,
PDConnector, Mooncake TCP) → answer, compared with a plain vLLM server."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import aiohttp
import pytest

from tests.e2e.conftest import (
    PREFILL_MAX_LEN,
    log_text,
    openai_chat_stream,
    plain_request,
    text_of,
    token_prompt,
)
from tests.e2e.observe import kv_usage, wait_no_blocks_held
from tests.e2e.test_pd_parity import BLOCK, LENGTHS

pytestmark = pytest.mark.slow


async def test_completions_through_proxy_equal_plain(pd_node, plain_server):
    for n in (10, 300):
        body = {"model": "tiny", "prompt": token_prompt(n, seed=70 + n), "max_tokens": 16,
                "temperature": 0}
        expected = await plain_request(plain_server, "/v1/completions", body)
        got = await plain_request(pd_node.spec.proxy_url, "/v1/completions", body)
        assert text_of(got) == text_of(expected)


async def test_streaming_chat_through_proxy_with_openai_client(pd_node, plain_server):
    messages = [{"role": "user", "content": "Tell me about a garden and the river."}]
    expected = await plain_request(plain_server, "/v1/chat/completions", {
        "model": "tiny", "messages": messages, "max_tokens": 20, "temperature": 0})
    pieces = await openai_chat_stream(pd_node.spec.proxy_url, messages, 20)
    assert len(pieces) > 1 and "".join(pieces) == text_of(expected)


async def test_prefill_rejection_reaches_client_and_frees_decode(pd_node):
    """P rejects a prompt that D accepts (too long for P): the client gets P's 400 at once,
    the proxy cancels D, and D's blocks are not left waiting for KV that never comes
    (InferenceX#2257, llm-d#2433)."""
    body = {"model": "tiny", "prompt": token_prompt(PREFILL_MAX_LEN + 200, seed=80),
            "max_tokens": 4, "temperature": 0}
    start = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body) as r:
            status, answer = r.status, await r.json()
    assert status == 400 and "error" in answer
    assert time.monotonic() - start < 5
    while kv_usage(pd_node.spec.decode_url) > 0:
        assert time.monotonic() - start < 6, "D still holds blocks for the rejected request"
        await asyncio.sleep(0.2)


async def test_proxy_reports_healthy_node(pd_node):
    async with aiohttp.ClientSession() as http:
        async with http.get(pd_node.spec.proxy_url + "/health") as r:
            assert r.status == 200
        async with http.get(pd_node.spec.proxy_url + "/status") as r:
            status = await r.json()
    assert "prefill-0" in str(status)


async def stream_through_proxy(node, path: str, body: dict) -> tuple[str, list[dict], str]:
    """(request id, the stream's JSON events, the text they carry)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(node.spec.proxy_url + path, json=body) as r:
            assert r.status == 200, await r.text()
            raw, rid = await r.text(), r.headers["X-Request-Id"]
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert raw.endswith("data: [DONE]\n\n")
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices", ()))
    return rid, events, text


def sent_blocks(node, transfer_id: str) -> int:
    """Blocks P's log says it wrote into D for this transfer (0: none)."""
    m = re.search(rf"sent p_req=\S+ d_req=\S+ transfer={re.escape(transfer_id)} blocks=(\d+)",
                  log_text(node.prefill.log_path))
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("length", LENGTHS)
async def test_first_token_from_prefill_equals_plain(pd_node, plain_server, length):
    """Streaming: P's token reaches the client first and D continues after it, from P's KV
    (also when P's prompt fills its last block exactly, so D's prompt plus P's token needs one
    block more than P holds)."""
    body = {"model": "tiny", "prompt": token_prompt(length, seed=200 + length),
            "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    expected = await plain_request(plain_server, "/v1/completions",
                                   {**body, "stream": False, "stream_options": None})
    rid, events, text = await stream_through_proxy(pd_node, "/v1/completions", body)
    assert text == text_of(expected)
    assert events[-1]["usage"] == {k: expected["usage"][k] for k in events[-1]["usage"]}
    assert sent_blocks(pd_node, f"xfer-{rid}") == -(-length // BLOCK)


async def test_first_token_that_is_the_first_bytes_of_a_character(pd_node, plain_server):
    """This prompt's first output token is the start of a multi-byte character, which P's
    answer reads as "". Continued by D after it, D's first chunk repeated the whole prompt's
    text; such a token goes the classic way (D gives every token, still from P's KV)."""
    body = {"model": "tiny", "prompt": token_prompt(130, seed=503), "max_tokens": 8,
            "temperature": 0}
    expected = await plain_request(plain_server, "/v1/completions", body)
    assert text_of(expected).startswith("\ufffd")  # the case this test is about
    rid, _, text = await stream_through_proxy(pd_node, "/v1/completions",
                                              {**body, "stream": True})
    assert text == text_of(expected)
    assert sent_blocks(pd_node, f"xfer-{rid}") == -(-130 // BLOCK)


async def test_first_token_chat_and_concurrency_equal_plain(pd_node, plain_server):
    bodies = [{"model": "tiny", "max_tokens": 12, "temperature": 0, "stream": True,
               "messages": [{"role": "user", "content": f"Tell me about river {i} and "
                                                          "the hills beyond it."}]}
              for i in range(4)]
    expected = [await plain_request(plain_server, "/v1/chat/completions",
                                    {**b, "stream": False}) for b in bodies]
    got = await asyncio.gather(*(stream_through_proxy(pd_node, "/v1/chat/completions", b)
                                 for b in bodies))
    assert [text for _, _, text in got] == [text_of(e) for e in expected]
    for rid, events, _ in got:
        assert {e["object"] for e in events} == {"chat.completion.chunk"}
        assert sent_blocks(pd_node, f"xfer-{rid}") > 0


async def test_first_token_that_ends_the_answer_frees_prefill_at_once(pd_node, plain_server):
    """P's one token is a stop token: the client's whole answer comes from P, D is never
    asked, and P frees the KV at once instead of holding it for send_timeout_s."""
    body = {"model": "tiny", "prompt": token_prompt(120, seed=301), "max_tokens": 8,
            "temperature": 0, "return_token_ids": True}
    first = (await plain_request(plain_server, "/v1/completions", body)
             )["choices"][0]["token_ids"][0]
    del body["return_token_ids"]
    start = time.monotonic()
    _, events, _ = await stream_through_proxy(
        pd_node, "/v1/completions", {**body, "stream": True, "stop_token_ids": [first]})
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    while kv_usage(pd_node.spec.prefill_url) > 0:
        # The tests' send_timeout_s is 15 s: well before it, or P held the blocks.
        assert time.monotonic() - start < 5, "P still holds the stopped request's KV"
        await asyncio.sleep(0.2)


async def test_streaming_request_too_long_for_decode_gets_json_400(pd_node, plain_server):
    """P takes it (one token), D would not (prompt + max_tokens beyond its context): the
    client gets a 400 JSON error as from one server, not a stream cut after P's token."""
    body = {"model": "tiny", "prompt": token_prompt(100, seed=501), "max_tokens": 4000,
            "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(plain_server + "/v1/completions", json=body) as r:
            assert r.status == 400  # the reference refuses it too
        async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body) as r:
            status, answer = r.status, await r.json()
    assert status == 400, answer
    assert answer["error"]["message"], answer


@pytest.mark.parametrize("linger", [0, 0.01, 0.03, 0.1, 0.3])
async def test_client_leaving_after_p_token_frees_both_sides(pd_node, linger):
    """The client reads P's token and hangs up `linger` s later, while D admits the request,
    waits for the KV, reads it, or has just finished reading it: D's request is aborted,
    neither side keeps blocks for it (dynamo#7489), and D's engine survives the abort
    crossing the pull's completion (a second report of it once crashed vLLM's scheduler)."""
    prompt = token_prompt(400, seed=600 + int(linger * 1000))  # no prefix cache hits
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # P's token
            await asyncio.sleep(linger)
    # P's send_timeout_s is 15 s here: well before it, or something failed to free P.
    await wait_no_blocks_held(pd_node, within=10)


async def test_several_choices_prefill_once_and_pull_once(pd_node):
    """n=2, sampled without a seed (vLLM refuses n>1 when greedy; a seeded request is
    served whole by one engine, test_pd_seeded.py): P prefills once (its token is thrown
    away, so one choice is enough); D pulls once (the second choice waits for the first's
    pull and reuses its blocks); both choices are whole."""
    body = {"model": "tiny", "prompt": token_prompt(90, seed=1201), "max_tokens": 8,
            "temperature": 1.0, "n": 2, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body,
                             headers={"X-Request-Id": "two-choices"}) as r:
            assert r.status == 200
            got = await r.json()
    assert sorted(c["index"] for c in got["choices"]) == [0, 1]
    assert got["usage"]["completion_tokens"] == 16
    assert len(re.findall(r"sent p_req=\S*cmpl-two-choices-",
                          log_text(pd_node.prefill.log_path))) == 1
    mine = [ln for ln in log_text(pd_node.prefill.log_path).splitlines()
            if "cmpl-two-choices-" in ln]
    assert not [ln for ln in mine if "already used by another prefill" in ln]
    # The second choice waited for the first's pull and used its blocks: no second pull.
    assert "already requested by" not in log_text(pd_node.decode.log_path)


async def test_burst_after_idle_transfers_every_kv(pd_node):
    """After the node idled past every keep-alive, 16 requests at once (both split modes):
    each one's KV really moves P -> D. Output parity cannot show this (a failed transfer is
    recomputed by D and gives the same text), so P's and D's logs are read per request
    (sglang#9266: transfers failing under concurrency or after the router idled)."""
    await asyncio.sleep(6)  # past the proxy's 4 s and uvicorn's 5 s keep-alive
    rng = random.Random(11)

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "tiny", "prompt": token_prompt(rng.randint(30, 700), seed=1100 + i),
                "max_tokens": 6, "temperature": 0, "stream": i % 2 == 0}
        async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body,
                             headers={"X-Request-Id": f"burst-{i}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(one(http, i) for i in range(16)))
    deadline = time.monotonic() + 10
    while True:  # the log lines are written by other processes' threads
        p_log, d_log = log_text(pd_node.prefill.log_path), log_text(pd_node.decode.log_path)
        missing = [i for i in range(16)
                   if not re.search(rf"sent p_req=\S+ d_req=cmpl-burst-{i}-", p_log)
                   or f"received d_req=cmpl-burst-{i}-" not in d_log]
        if not missing:
            break
        assert time.monotonic() < deadline, f"no complete transfer for burst-{missing}"
        await asyncio.sleep(0.5)
    assert "burst-" not in "".join(line for line in (p_log + d_log).splitlines(True)
                                   if "-> failed" in line)


async def test_clients_hanging_up_at_random_leave_nothing_held(pd_node, plain_server):
    """Many clients, both split modes, streaming or not, each hanging up at a random moment
    (during P's prefill, D's admission, the transfer, decoding, or never): afterwards both
    engines are alive, no block is held on either side well before P's send_timeout_s, and
    the next request's output is still a plain server's."""
    rng = random.Random(7)

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "tiny", "prompt": token_prompt(rng.randint(20, 600), seed=900 + i),
                "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": rng.random() < 0.7}
        if rng.random() < 0.3:
            body["stop"] = ["never-said"]  # not eligible for P's token first
        hang_up = rng.choice([None, 0.0, *(rng.uniform(0, 1.5) for _ in range(4))])

        async def request() -> None:
            async with http.post(pd_node.spec.proxy_url + "/v1/completions", json=body) as r:
                await r.read()
        try:
            await asyncio.wait_for(request(), hang_up if hang_up is not None else 120)
        except asyncio.TimeoutError:
            pass

    async with aiohttp.ClientSession() as http:
        for wave in range(4):
            await asyncio.gather(*(one(http, wave * 6 + k) for k in range(6)))
        await wait_no_blocks_held(pd_node, within=10)
        for url in (pd_node.spec.prefill_url, pd_node.spec.decode_url):
            async with http.get(url + "/health") as r:
                assert r.status == 200, f"{url} is not healthy after the hang-ups"
    body = {"model": "tiny", "prompt": token_prompt(100, seed=999), "max_tokens": 16,
            "temperature": 0}
    expected = await plain_request(plain_server, "/v1/completions", body)
    got = await plain_request(pd_node.spec.proxy_url, "/v1/completions", body)
    assert text_of(got) == text_of(expected)


async def test_zz_no_blocks_left_held_after_the_proxy_tests(pd_node):
    """After every request through the proxy above (both modes, all failure paths)."""
    await wait_no_blocks_held(pd_node)
