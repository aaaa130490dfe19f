"""`POST /v1/responses` through the node with real vLLM: greedy responses, JSON and
streamed, equal a plain server's under every split policy (`always`: P's KV reaches D
through the Responses path; `never`: D alone; `auto`), and a continued response that no
node stored gets the plain server's 404. The node's own proxy splits always; two more
(never, auto) stand in front of the same P and D."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import proxies_in_front
from tests.e2e.observe import metric, wait_no_blocks_held

pytestmark = pytest.mark.slow

PATH = "/v1/responses"
DELTA = "response.output_text.delta"
ASKS = [
    {"instructions": "You answer in one line.", "input": "Name three rivers and a mountain."},
    {"input": [{"role": "user", "content": "Say something about the sea."}]},
]


@pytest.fixture(scope="module")
def proxies(pd_node, tmp_path_factory):
    """{"always": the node's own proxy, "never": url, "auto": url}."""
    with proxies_in_front(pd_node, tmp_path_factory, never=("--split", "never"),
                          auto=()) as out:
        yield {**out, "always": pd_node.spec.proxy_url}


def body(ask: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_output_tokens": 16, "temperature": 0, **ask, **extra}


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


async def whole(http: aiohttp.ClientSession, base: str, data: dict[str, Any]
                ) -> tuple[int, dict[str, Any]]:
    async with http.post(base + PATH, json=data) as r:
        return r.status, json.loads(await r.read())


async def streamed(http: aiohttp.ClientSession, base: str, data: dict[str, Any]
                   ) -> tuple[list[str], str, dict[str, Any]]:
    """The stream's event types, its delta text, and its last event's response."""
    async with http.post(base + PATH, json={**data, "stream": True}) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    # How many tokens one delta event carries depends on timing (vLLM merges outputs
    # its API server had not taken yet): a run of deltas counts as one.
    kinds: list[str] = []
    for e in events:
        kind = e.split("\n")[0].removeprefix("event: ")
        if not (kinds and kind == kinds[-1] == DELTA):
            kinds.append(kind)
    payloads = [json.loads(e.split("\n", 1)[1].removeprefix("data: ")) for e in events]
    text = "".join(p["delta"] for p in payloads if p["type"] == DELTA)
    return kinds, text, payloads[-1].get("response", {})


async def answers(base: str) -> list[Any]:
    """Per ask: the JSON response's status, text and output tokens; the stream's event
    types, its text and its final response's text."""
    out: list[Any] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for ask in ASKS:
            status, got = await whole(http, base, body(ask))
            assert status == 200, got
            out.append((got["status"], output_text(got), got["usage"]["output_tokens"]))
            kinds, text, final = await streamed(http, base, body(ask))
            out.append((kinds, text, output_text(final)))
    return out


async def test_responses_equal_a_plain_server_under_every_split(pd_node, plain_server,
                                                                  proxies):
    expected = await answers(plain_server)
    assert expected[0][1] and expected[1][1]  # the model said something
    assert expected[1][0][-1] == "response.completed"
    d = pd_node.spec.decode_url
    received = metric(d, "vllm:pd_kv_received_total")
    # always: P prefills each (max_output_tokens 1), D pulls its KV through the
    # Responses path's kv_transfer_params and decodes.
    assert await answers(proxies["always"]) == expected
    assert metric(d, "vllm:pd_kv_received_total") - received == 2 * len(ASKS)
    for name in ("never", "auto"):
        assert await answers(proxies[name]) == expected, name
    assert metric(proxies["never"],
                  'pd_proxy_split_decisions_total{decision="local",reason="policy"}') \
        == 2 * len(ASKS)
    await wait_no_blocks_held(pd_node, within=60)


async def test_the_openai_client_through_the_node(pd_node, plain_server, proxies):
    import openai

    async def text(base: str) -> str:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused")
        try:
            stream = await client.responses.create(model="tiny", temperature=0,
                                                   max_output_tokens=12, stream=True,
                                                   **ASKS[0])
            return "".join([e.delta async for e in stream
                            if e.type == "response.output_text.delta"])
        finally:
            await client.close()

    assert await text(proxies["always"]) == await text(plain_server)


async def test_an_unstored_previous_response_is_a_404_as_on_a_plain_server(
        plain_server, proxies):
    """The nodes keep no responses (VLLM_ENABLE_RESPONSES_API_STORE unset, vLLM's
    default): continuing one is refused as a plain server refuses it."""
    async with aiohttp.ClientSession() as http:
        status, first = await whole(http, proxies["always"], body(ASKS[0]))
        assert status == 200
        again = body(ASKS[1], previous_response_id=first["id"])
        plain_status, plain = await whole(http, plain_server, again)
        node_status, node = await whole(http, proxies["always"], again)
    assert plain_status == node_status == 404
    assert first["id"] in node["error"]["message"]
