"""vLLM's routes the node passes on (/tokenize, /detokenize, /version) answer through the
proxy as one plain vLLM server of the same model answers them; a body nested 100,000
levels deep is the client's 400."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "Name three rivers and a mountain."}]


async def _both(node: str, plain: str, path: str, body: Any = None) -> tuple[Any, Any]:
    """(status, JSON) from the node's proxy and from the plain server."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        out = []
        for base in (node, plain):
            call = http.get(base + path) if body is None else http.post(base + path, json=body)
            async with call as r:
                out.append((r.status, await r.json(content_type=None)))
        return out[0], out[1]


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": "Hello world, how are you?"},
    {"model": "tiny", "prompt": "Hello world", "add_special_tokens": False,
     "return_token_strs": True},
    {"model": "tiny", "messages": MESSAGES},
    {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": False},
], ids=["prompt", "prompt-strs", "chat", "chat-no-generation-prompt"])
async def test_tokenize_equals_plain_server(pd_node, plain_server, body) -> None:
    got, expected = await _both(pd_node.spec.proxy_url, plain_server, "/tokenize", body)
    assert got == expected and got[0] == 200
    assert got[1]["count"] == len(got[1]["tokens"]) > 0
    # Round trip: the ids back to text, through the node as through vLLM.
    detok = {"model": "tiny", "tokens": got[1]["tokens"]}
    got, expected = await _both(pd_node.spec.proxy_url, plain_server, "/detokenize", detok)
    assert got == expected and got[0] == 200 and got[1]["prompt"]


async def test_version_equals_plain_server(pd_node, plain_server) -> None:
    got, expected = await _both(pd_node.spec.proxy_url, plain_server, "/version")
    assert got == expected and got[0] == 200 and got[1]["version"]


async def test_tokenize_errors_as_plain_server(pd_node, plain_server) -> None:
    for body in ({"model": "tiny"}, {"model": "no-such-model", "prompt": "x"}):
        got, expected = await _both(pd_node.spec.proxy_url, plain_server, "/tokenize", body)
        assert got[0] == expected[0] and got[0] >= 400, (body, got, expected)
        assert got[1]["error"]["message"] == expected[1]["error"]["message"], body


async def test_deep_json_is_the_clients_400(pd_node) -> None:
    deep = b'{"a":' * 100_000
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            async with http.post(pd_node.spec.proxy_url + path, data=deep) as r:
                assert r.status == 400, path
                assert "nested too deeply" in (await r.json())["error"]["message"]
