"""A real 1P1D node on this machine: bootstrap + vLLM P + vLLM D (CPU build) with
PDConnector over Mooncake TCP, plus a plain vLLM server as the parity reference."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.localnode import LocalNode, NodeSpec
from appliance.process import ServiceProcess
from appliance.proxy.exchange.bodies import decode_body, prefill_body
from tests.conftest import free_port
from tests.faults.launch import fault_env, faulty_config
from tests.otlp import Collector

# Short deadlines so failure paths finish quickly in tests.
TEST_CONNECTOR = {"recv_timeout_s": 8, "send_timeout_s": 15, "cancel_grace_s": 2}
PREFILL_MAX_LEN = 1024
HOLD = "hold-prefills"


@dataclass
class FaultyNodeSpec(NodeSpec):
    """A node whose P and/or D run with a fault plan (tests.faults.plan's syntax): that
    role's vLLM loads the fault-injection connector (tests.faults.connector); a role
    without a plan runs the product's."""

    prefill_faults: str = ""
    decode_faults: str = ""

    def __post_init__(self) -> None:
        if self.prefill_faults:
            self.prefill_env = {**self.prefill_env, **fault_env(self.prefill_faults)}
        if self.decode_faults:
            self.decode_env = {**self.decode_env, **fault_env(self.decode_faults)}

    def kv_transfer_config(self, role: str) -> str:
        config = super().kv_transfer_config(role)
        plan = self.prefill_faults if role == "kv_producer" else self.decode_faults
        return faulty_config(config) if plan else config


@contextmanager
def running_node(tiny_model: Path, log_dir: Path, timeout: float = 400,
                 **spec: Any) -> Iterator[LocalNode]:
    """A node of the tiny model on free ports, stopped afterwards whatever happens. Its
    proxy splits every request (these tests are about P, the transfer and D); placement
    by `auto`, the default, has tests of its own (test_pd_placement.py). `prefill_faults`
    and `decode_faults` inject faults there (FaultyNodeSpec)."""
    spec.setdefault("connector_extra", dict(TEST_CONNECTOR))
    spec.setdefault("proxy_args", (*NodeSpec.proxy_args, "--split", "always"))
    kind = FaultyNodeSpec if {"prefill_faults", "decode_faults"} & spec.keys() else NodeSpec
    node = LocalNode(kind(model=tiny_model, prefill_port=free_port(),
                          decode_port=free_port(), bootstrap_port=free_port(),
                          log_dir=log_dir, **spec))
    node.start(timeout=timeout)
    try:
        yield node
    finally:
        node.stop()


def second_proxy(node: LocalNode, log_dir: Path, *args: str) -> tuple[ServiceProcess, str]:
    """Another proxy in front of the node's P and D, with its own settings (not started):
    the process and its URL."""
    port = free_port()
    s = node.spec
    url = f"http://127.0.0.1:{port}"
    return ServiceProcess(
        "second-proxy",
        [sys.executable, "-m", "appliance.proxy", "--host", "127.0.0.1", "--port", str(port),
         "--prefill", f"{s.prefill_url},{s.bootstrap_url}", "--decode", s.decode_url,
         "--health-interval", "0.5", *args],
        log_dir / "second-proxy.log", health_url=f"{url}/health"), url


@contextmanager
def proxies_in_front(node: LocalNode, tmp_path_factory: pytest.TempPathFactory,
                     **named: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Second proxies (one per name, with those arguments) started in front of the node's P
    and D: {name: url, f"{name}_log": its log}; stopped afterwards."""
    out: dict[str, Any] = {}
    started: list[ServiceProcess] = []
    try:
        for name, args in named.items():
            svc, url = second_proxy(node, tmp_path_factory.mktemp(f"proxy-{name}"), *args)
            svc.start()
            started.append(svc)
            svc.wait_healthy(60)
            out[name], out[f"{name}_log"] = url, svc.log_path
        yield out
    finally:
        for svc in started:
            svc.stop()


@pytest.fixture(scope="module")
def split_proxies(pd_node, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A proxy per split in front of pd_node's P and D: {"always": the node's own,
    "never": url, "auto": url (the proxy's default)}."""
    with proxies_in_front(pd_node, tmp_path_factory, never=("--split", "never"),
                          auto=()) as out:
        out["always"] = pd_node.spec.proxy_url
        yield out


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[Collector]:
    """The OTLP/HTTP receiver pd_node's P and D export their traces to."""
    with Collector() as c:
        yield c


@pytest.fixture(scope="session")
def pd_node(tiny_model, tmp_path_factory, otlp_collector):
    # P accepts shorter prompts than D, so P can reject what D accepts. P holds new
    # prefills back while a test makes its hold file (hold_prefills: a backed-up P). P, D
    # and the proxy export traces (test_pd_tracing).
    logs = tmp_path_factory.mktemp("pd-node")
    with running_node(tiny_model, logs, proxy_port=free_port(),
                      prefill_args=("--max-model-len", str(PREFILL_MAX_LEN)),
                      prefill_faults=f"prefill_hold_file={logs / HOLD}",
                      otlp_traces_endpoint=otlp_collector.url,
                      otlp_traces_protocol="http/protobuf") as node:
        yield node


@contextmanager
def hold_prefills(node: LocalNode) -> Iterator[None]:
    """P (pd_node's) starts no prefill for a decode node meanwhile: they wait in its queue,
    as behind a backlog (its connector is tests.faults')."""
    path = node.spec.log_dir / HOLD
    path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


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
    """Split one request the way the proxy does (docs/protocol.md steps 9-10) and send both
    at once."""
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


async def ask(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    """(status, text) of a completion through `url`: 200 with the answer's text (a
    stream's joined from its events), or the error's status and body (a stream that
    failed, with an SSE error event or without [DONE], counts as 502)."""
    async with http.post(url + "/v1/completions", json=body) as r:
        raw = await r.text()
        if r.status != 200:
            return r.status, raw
    if not body.get("stream"):
        return 200, json.loads(raw)["choices"][0]["text"]
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    if any("error" in e for e in events) or not raw.endswith("data: [DONE]\n\n"):
        return 502, raw
    return 200, "".join(c.get("text", "") for e in events for c in e.get("choices", ()))


def text_of(result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def log_text(path: Path) -> str:
    return path.read_text(errors="replace")
