"""A real 1P1D node on this machine: bootstrap + vLLM P + vLLM D (CPU build) with
PDConnector over Mooncake TCP, plus a plain vLLM server as the parity reference."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.localnode import LocalNode, NodeSpec
from appliance.proxy.split import decode_body, prefill_body
from tests.conftest import free_port

# Short deadlines so failure paths finish quickly in tests.
TEST_CONNECTOR = {"recv_timeout_s": 8, "send_timeout_s": 15, "cancel_grace_s": 2}
PREFILL_MAX_LEN = 1024


@contextmanager
def running_node(tiny_model: Path, log_dir: Path, timeout: float = 400,
                 **spec: Any) -> Iterator[LocalNode]:
    """A node of the tiny model on free ports, stopped afterwards whatever happens."""
    spec.setdefault("connector_extra", dict(TEST_CONNECTOR))
    node = LocalNode(NodeSpec(model=tiny_model, prefill_port=free_port(),
                              decode_port=free_port(), bootstrap_port=free_port(),
                              log_dir=log_dir, **spec))
    node.start(timeout=timeout)
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def pd_node(tiny_model, tmp_path_factory):
    # P accepts shorter prompts than D, so P can reject what D accepts.
    with running_node(tiny_model, tmp_path_factory.mktemp("pd-node"), proxy_port=free_port(),
                      prefill_args=("--max-model-len", str(PREFILL_MAX_LEN))) as node:
        yield node


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


async def post_json(http: aiohttp.ClientSession, url: str, body: dict,
                    timeout: float = 120) -> tuple[int, dict]:
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, json.loads(await r.read())


async def pd_request(node: LocalNode, path: str, body: dict, *, p_extra: dict | None = None,
                     transfer_id: str | None = None, p_body: dict | None = None,
                     send_p: bool = True) -> tuple[dict, dict | None]:
    """Split one request the way the proxy does (seeds steps 9-10) and send both at once."""
    transfer_id = transfer_id or f"xfer-{uuid.uuid4()}"
    p = {**prefill_body(p_body or body, path, transfer_id), **(p_extra or {})}
    d = decode_body(body, transfer_id, node.spec.bootstrap_url, node.spec.prefill_engine_id)
    async with aiohttp.ClientSession() as http:
        d_task = asyncio.create_task(post_json(http, node.spec.decode_url + path, d))
        p_result = None
        if send_p:
            p_status, p_result = await post_json(http, node.spec.prefill_url + path, p)
            assert p_status == 200, p_result
        d_status, d_result = await d_task
        assert d_status == 200, d_result
    return d_result, p_result


async def plain_request(base: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as http:
        status, result = await post_json(http, base + path, body)
        assert status == 200, result
        return result


async def openai_chat_stream(base: str, messages: list[dict], max_tokens: int) -> list[str]:
    """The text pieces of a greedy streaming chat through the openai client."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused")
    try:
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
        return [c.choices[0].delta.content or "" async for c in stream if c.choices]
    finally:
        await client.close()


def text_of(result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def log_text(path: Path) -> str:
    return path.read_text(errors="replace")
