"""D SIGKILLed mid-answer on a 1P1D node (real vLLM P and D on CPU, the tiny model): the
answer goes on from P and the client gets it whole, token for token a plain server's
(appliance.proxy.exchange.migration). A stream led by P's token, or served by D alone,
continues after the tokens the client has, in the same stream; a whole answer is asked
again of P. D is started again after each, and nothing is held at the end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import (
    plain_request,
    running_node,
    second_proxy,
    text_of,
    token_prompt,
)
from tests.e2e.observe import in_rotation, metric, wait_no_blocks_held

pytestmark = pytest.mark.slow

LONG = 600  # tokens: D is killed well before the end
MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    with running_node(tiny_model, tmp_path_factory.mktemp("migration"),
                      proxy_port=free_port()) as n:
        yield n


def _body(route: str, stream: bool) -> dict:
    body = {"model": "tiny", "max_tokens": LONG, "ignore_eos": True, "temperature": 0,
            "stream": stream}
    if route == "chat":
        return {**body, "messages": MESSAGES}
    return {**body, "prompt": token_prompt(40, seed=5200)}


def _path(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


def _kill_d(node) -> None:
    os.killpg(node.decode.proc.pid, signal.SIGKILL)
    node.decode.proc.wait(10)


async def _d_again(node) -> None:
    node.decode.start()
    await asyncio.to_thread(node.decode.wait_healthy, 300)
    await in_rotation(node, "decode", within=60)


def _piece(event: dict) -> str:
    choice = event["choices"][0]
    return choice["delta"].get("content") or "" if "delta" in choice else choice["text"]


@pytest.fixture(scope="module")
def alone(node, tmp_path_factory) -> Iterator[str]:
    """A second proxy in front of the node that never splits: every request on D alone
    (as `auto` places a lone request on an idle node). Its URL."""
    proxy, url = second_proxy(node, tmp_path_factory.mktemp("alone"), "--split", "never")
    proxy.start()
    try:
        proxy.wait_healthy(60)
        yield url
    finally:
        proxy.stop()


async def _stream(url: str, route: str, reached: asyncio.Event) -> tuple[list[dict], bool]:
    """A long stream through the proxy at `url` (`reached` set once 8 events came): its
    events and whether it ended with [DONE]."""
    events: list[dict] = []
    done = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        async with http.post(url + _path(route), json=_body(route, True)) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 8:  # some of D's tokens reached the client
                        reached.set()
    return events, done


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_d_killed_mid_stream_the_streams_go_on_from_p(node, alone, plain_server, route):
    """D killed under two streams at once: one led by P's token, one D serves alone
    (followed by its token ids); both go on from P after the tokens their client has."""
    expected = text_of(await plain_request(plain_server, _path(route), _body(route, False)))
    key = 'pd_proxy_migrations_total{how="continued"}'
    before = metric(node.spec.proxy_url, key), metric(alone, key)
    reached = [asyncio.Event(), asyncio.Event()]
    streams = [asyncio.create_task(_stream(url, route, ev))
               for url, ev in zip((node.spec.proxy_url, alone), reached, strict=True)]
    try:
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in reached)), 120)
        _kill_d(node)
        for events, done in await asyncio.gather(*streams):
            assert done and not [e for e in events if "error" in e]
            assert "".join(_piece(e) for e in events if e.get("choices")) == expected
            assert not [e for e in events if e.get("prompt_token_ids")
                        or any(c.get("token_ids") for c in e["choices"])]
        assert (metric(node.spec.proxy_url, key), metric(alone, key)) == \
            (before[0] + 1, before[1] + 1)
    finally:
        for task in streams:
            task.cancel()
        await _d_again(node)
        await in_rotation(node, "decode", within=60, proxy=alone)
    await wait_no_blocks_held(node, within=60)


async def _events(url: str, route: str, max_tokens: int) -> list[dict]:
    body = {**_body(route, True), "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        async with http.post(url + _path(route), json=body) as r:
            assert r.status == 200
            raw = await r.read()
    out = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    for e in out:  # a request's own, and each server's (a hash of its configuration)
        e.pop("id"), e.pop("created"), e.pop("system_fingerprint", None)
    return out


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_d_alone_stream_is_a_plain_servers_chunk_for_chunk(alone, plain_server, route):
    """Followed by its token ids (asked of D, taken out), a D-alone stream's chunks are
    the ones a plain server sends a client that did not ask for them."""
    assert await _events(alone, route, 24) == await _events(plain_server, route, 24)


async def test_d_killed_mid_whole_answer_p_answers_it(node, plain_server):
    body = _body("completions", False)
    expected = text_of(await plain_request(plain_server, "/v1/completions", body))
    before = metric(node.spec.proxy_url, 'pd_proxy_migrations_total{how="whole"}')
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        ask = asyncio.create_task(http.post(node.spec.proxy_url + "/v1/completions",
                                            json=body))
        try:
            # D decodes it (its gauge says so), then dies before the answer's end.
            for _ in range(300):
                if metric(node.spec.decode_url, "vllm:num_requests_running") >= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("D never ran the request")
            await asyncio.sleep(0.3)
            _kill_d(node)
            async with await ask as r:
                assert r.status == 200, await r.text()
                assert text_of(await r.json()) == expected
            assert metric(node.spec.proxy_url,
                          'pd_proxy_migrations_total{how="whole"}') == before + 1
        finally:
            await _d_again(node)
    await wait_no_blocks_held(node, within=60)
