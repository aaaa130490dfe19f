"""The whole request path as users meet it: client → proxy :8000 → P and D (real vLLM,
PDConnector, Mooncake TCP) → answer, compared with a plain vLLM server."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from tests.e2e.conftest import PREFILL_MAX_LEN, plain_request, text_of, token_prompt
from tests.e2e.test_pd_parity import _kv_usage

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
    client = openai.AsyncOpenAI(base_url=pd_node.spec.proxy_url + "/v1", api_key="unused")
    stream = await client.chat.completions.create(model="tiny", messages=messages,
                                                  max_tokens=20, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream
              if chunk.choices]
    await client.close()
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
    while _kv_usage(pd_node.spec.decode_url) > 0:
        assert time.monotonic() - start < 6, "D still holds blocks for the rejected request"
        await asyncio.sleep(0.2)


async def test_proxy_reports_healthy_node(pd_node):
    async with aiohttp.ClientSession() as http:
        async with http.get(pd_node.spec.proxy_url + "/health") as r:
            assert r.status == 200
        async with http.get(pd_node.spec.proxy_url + "/status") as r:
            status = await r.json()
    assert "prefill-0" in str(status)
