"""A node in secure mode (what `pdctl up --local` runs), attacked the ways the issue lists,
against real servers: only the proxy answers without a key, and it still gives a plain
server's output."""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest
from aiohttp import web

from appliance.proxy.exchange.bodies import decode_body, prefill_body
from tests import netlisten
from tests.conftest import free_port
from tests.e2e.conftest import (
    openai_chat_stream,
    plain_request,
    running_node,
    text_of,
    token_prompt,
)
from tests.e2e.observe import wait_no_blocks_held

pytestmark = pytest.mark.slow

MC_PORTS = (23100, 23199)  # Mooncake's ports come from here (MC_MIN/MAX_RPC_PORT)


@pytest.fixture(scope="module")
def secure_node(tiny_model, tmp_path_factory):
    env = {"MC_MIN_RPC_PORT": str(MC_PORTS[0]), "MC_MAX_RPC_PORT": str(MC_PORTS[1])}
    with running_node(tiny_model, tmp_path_factory.mktemp("secure-node"), secure=True,
                      proxy_port=free_port(), extra_env=env) as node:
        yield node


async def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers or {}) as r:
            return r.status, json.loads(await r.read())


def _body(n: int = 20, seed: int = 1) -> dict:
    return {"model": "tiny", "prompt": token_prompt(n, seed), "max_tokens": 8,
            "temperature": 0}


async def test_direct_requests_to_p_and_d_without_the_key_get_401(secure_node):
    spec, tid = secure_node.spec, f"xfer-{uuid.uuid4()}"
    p_body = prefill_body(_body(), "/v1/completions", tid)  # do_remote_decode: P would hold KV
    d_body = decode_body(_body(), tid, spec.bootstrap_url, spec.prefill_engine_id)
    for url, body in ((spec.prefill_url, p_body), (spec.decode_url, d_body),
                      (spec.decode_url, _body())):
        for headers in (None, {"Authorization": "Bearer wrong"}):
            status, _ = await _post(url + "/v1/completions", body, headers)
            assert status == 401, url
    await wait_no_blocks_held(secure_node, within=10)


async def test_d_refuses_a_foreign_bootstrap_and_fetches_nothing(secure_node):
    asked: list[str] = []

    async def record(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        spec = secure_node.spec
        body = decode_body(_body(), f"xfer-{uuid.uuid4()}", f"http://127.0.0.1:{port}",
                           spec.prefill_engine_id)
        status, answer = await _post(spec.decode_url + "/v1/completions", body,
                                     secure_node.auth_headers("decode"))
        assert status == 400, answer
        assert answer["error"]["type"] == "invalid_request_error"
        assert "remote_bootstrap_addr" in answer["error"]["message"]
        assert asked == []  # nothing was fetched from the foreign sidecar
        # The node's own sidecar, with the key, is accepted (a local prefill if P has no KV).
        ok = decode_body(_body(), f"xfer-{uuid.uuid4()}", spec.bootstrap_url,
                         spec.prefill_engine_id)
        assert (await _post(spec.decode_url + "/v1/completions", ok,
                            secure_node.auth_headers("decode")))[0] == 200
    finally:
        await runner.cleanup()
    await wait_no_blocks_held(secure_node, within=30)


async def test_kv_events_are_read_with_the_cluster_key_alone(secure_node):
    """D's KV events carry every cached prompt's token ids: a subscriber without the
    cluster's key reads nothing of them, while the proxy (which holds it) reads them all
    (appliance.connector.kvevents)."""
    import asyncio

    import zmq

    spec = secure_node.spec
    async with aiohttp.ClientSession() as http:
        async with http.get(spec.decode_url + "/kv_event_sources") as r:
            sources = await r.json()
    endpoint = next(iter(sources.values()))["endpoint"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        before = await _d_batches(secure_node)
        for seed in range(3):  # new prompts: D stores blocks and publishes them
            status, _ = await _post(spec.proxy_url + "/v1/completions", _body(64, 700 + seed))
            assert status == 200
        for _ in range(50):
            if await _d_batches(secure_node) > before:
                break
            await asyncio.sleep(0.1)
        assert await _d_batches(secure_node) > before  # the proxy, with the key, read them
        assert not sub.poll(500)  # the stranger, none
    finally:
        sub.close()
        ctx.term()


async def _d_batches(node) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(node.spec.proxy_url + "/status") as r:
            status = await r.json()
    return sum(s["batches"] for s in status["prefix"]["nodes"].get(node.spec.decode_url,
                                                                   {}).values())


async def test_bootstrap_needs_its_token_to_register_and_query(secure_node):
    url = secure_node.spec.bootstrap_url
    reg = {"engine_id": "intruder", "addr": "tcp://127.0.0.1:1", "dp_rank": 0, "tp_rank": 0,
           "pp_rank": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/register", json=reg) as r:
            assert r.status == 401
        async with http.get(url + "/query") as r:
            assert r.status == 401
        async with http.delete(url + f"/engines/{secure_node.spec.prefill_engine_id}") as r:
            assert r.status == 401
        async with http.get(url + "/query", headers=secure_node.auth_headers("bootstrap")) as r:
            engines = [v["engine_id"] for v in (await r.json()).values()]
    assert engines == [secure_node.spec.prefill_engine_id]  # no intruder, P still there


async def test_proxy_gives_a_plain_servers_output(secure_node, plain_server):
    for n in (10, 300):
        body = {**_body(n, seed=90 + n), "max_tokens": 16}
        expected = await plain_request(plain_server, "/v1/completions", body)
        got = await plain_request(secure_node.spec.proxy_url, "/v1/completions", body)
        assert text_of(got) == text_of(expected)
    messages = [{"role": "user", "content": "Tell me about the river."}]
    expected = await plain_request(plain_server, "/v1/chat/completions", {
        "model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0})
    pieces = await openai_chat_stream(secure_node.spec.proxy_url, messages, 16)
    assert "".join(pieces) == text_of(expected)
    log = (secure_node.spec.log_dir / "decode.log").read_text(errors="replace")
    assert "received d_req=" in log  # D pulled P's KV through the CURVE side channel
    await wait_no_blocks_held(secure_node)


def test_nothing_listens_on_a_wildcard_but_mooncake_in_its_range(secure_node):
    listeners = netlisten.listeners(netlisten.descendants(
        {svc.proc.pid for svc in secure_node.services}))
    assert listeners, "no listening socket found for the node's processes"
    wildcard = [(a, p) for a, p, _ in listeners if a in netlisten.WILDCARDS]
    assert wildcard, "Mooncake's listeners were expected (it binds every address)"
    for addr, port in wildcard:
        assert MC_PORTS[0] <= port <= MC_PORTS[1], f"{addr}:{port} listens on every address"
    assert {a for a, _, _ in listeners} - netlisten.WILDCARDS == {"127.0.0.1"}
    spec = secure_node.spec
    bound = {p for a, p, _ in listeners if a == "127.0.0.1"}
    assert {spec.prefill_port, spec.decode_port, spec.bootstrap_port, spec.proxy_port} <= bound
