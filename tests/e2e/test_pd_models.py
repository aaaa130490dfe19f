"""Parity through P→D for the other model families PD users run, each against a plain vLLM
server of the same model: MLA (DeepSeek-style, one latent per layer, blocks of 16 on CPU)
and sliding-window + full-attention layers (two KV-cache groups, each with its own block
table). Same proof as test_pd_parity: token for token, completions and chat, sequential and
concurrent, D really used P's KV, and no block held afterwards."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from tests.conftest import MODEL_CACHE, free_port, running_plain_server
from tests.e2e.conftest import (
    log_text,
    pd_request,
    plain_request,
    running_node,
    text_of,
    token_prompt,
)
from tests.e2e.observe import metric, wait_no_blocks_held
from tests.e2e.test_pd_parity import tokens_of

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Family:
    size: str  # appliance.tinymodel size
    block: int  # the block size vLLM's CPU build runs it with
    window: int | None = None  # sliding window, in tokens

    def lengths(self) -> list[int]:
        """Shorter than a block, exactly N blocks, N blocks + a few, several hundred, and
        (with a window) longer than the window."""
        out = [5, 2 * self.block, 2 * self.block + 3, 450]
        if self.window:
            out.append(self.window + 3 * self.block + 7)
        return out


FAMILIES = {"mla": Family("mla", block=16), "sliding": Family("sliding", block=32, window=64)}


@dataclass
class Setup:
    family: Family
    node: object
    plain: str


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
    from appliance import tinymodel

    family = FAMILIES[request.param]
    model = tinymodel.build(MODEL_CACHE / family.size, family.size)
    logs = tmp_path_factory.mktemp(f"models-{family.size}")
    serve = tinymodel.SIZES[family.size].serve_args  # float32 stays float32
    with running_plain_server(model, "tiny", logs / "plain", extra=serve) as plain, \
            running_node(model, logs / "node", proxy_port=free_port(), prefill_args=serve,
                         decode_args=serve) as node:
        yield Setup(family, node, plain)


def completion(prompt, max_tokens=16, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}


async def test_completions_equal_plain_server(setup):
    for length in setup.family.lengths():
        body = completion(token_prompt(length, seed=length))
        expected = await plain_request(setup.plain, "/v1/completions", body)
        got, p_result = await pd_request(setup.node, "/v1/completions", body)
        assert tokens_of(got) == tokens_of(expected), f"prompt of {length} tokens"
        assert p_result["usage"]["completion_tokens"] == 1


async def test_chat_equals_plain_server(setup):
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three rivers and a mountain."}]}
    expected = await plain_request(setup.plain, "/v1/chat/completions", body)
    got, _ = await pd_request(setup.node, "/v1/chat/completions", body)
    assert text_of(got) == text_of(expected) and text_of(got)
    through_proxy = await plain_request(setup.node.spec.proxy_url, "/v1/chat/completions", body)
    assert text_of(through_proxy) == text_of(expected)


async def test_concurrent_requests_equal_plain_server(setup):
    bodies = [completion(token_prompt(20 + 53 * i, seed=300 + i), max_tokens=10)
              for i in range(5)]
    expected = [await plain_request(setup.plain, "/v1/completions", b) for b in bodies]
    got = await asyncio.gather(*(pd_request(setup.node, "/v1/completions", b) for b in bodies))
    assert [tokens_of(g) for g, _ in got] == [tokens_of(e) for e in expected]


async def test_decode_really_uses_prefill_kv(setup):
    """D gets prompt B, P prompt A (same length, same last token): D's answer follows A."""
    a = token_prompt(100, seed=17)
    b = token_prompt(100, seed=18)
    b[-1] = a[-1]
    plain_a = await plain_request(setup.plain, "/v1/completions", completion(a))
    plain_b = await plain_request(setup.plain, "/v1/completions", completion(b))
    assert tokens_of(plain_a) != tokens_of(plain_b)
    got, _ = await pd_request(setup.node, "/v1/completions", completion(b),
                              p_body=completion(a))
    assert tokens_of(got) == tokens_of(plain_a)
    assert "received d_req=" in log_text(setup.node.decode.log_path)


async def test_z_every_transfer_landed_and_no_blocks_left_held(setup):
    """No request above fell back to recomputing on D: each one's KV came from P."""
    d = setup.node.spec.decode_url
    assert metric(d, "vllm:pd_kv_failed_receives_total") == 0
    assert metric(d, "vllm:pd_kv_received_total") >= len(setup.family.lengths()) + 7
    await wait_no_blocks_held(setup.node)
