"""The happy path: what P and D receive, streaming chunk by chunk, the openai client."""

from __future__ import annotations

import asyncio
import re

import openai

from tests.proxy.conftest import Cluster

XFER_RE = re.compile(r"xfer-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")


async def test_exact_bodies_for_a_completion(cluster: Cluster) -> None:
    client = {"model": "tiny", "prompt": "hello", "max_tokens": 128, "temperature": 0,
              "kv_transfer_params": {"do_remote_prefill": True,
                                     "remote_bootstrap_addr": "http://attacker:8998"}}
    status, data, _ = await cluster.post(body=client, headers={"X-Request-Id": "req-42"})
    assert status == 200
    assert data["choices"][0]["text"] == "t0 t1 t2 t3"  # D's answer, untouched
    (p,), (d,) = cluster.prefill[0].received, cluster.decode[0].received
    xfer = p.body["kv_transfer_params"]["transfer_id"]
    assert XFER_RE.fullmatch(xfer)
    assert p.path == d.path == "/v1/completions"
    assert p.body == {
        "model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "transfer_id": xfer},
    }
    assert d.body == {
        "model": "tiny", "prompt": "hello", "max_tokens": 128, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                               "remote_bootstrap_addr": cluster.bootstraps[0].url,
                               "remote_engine_id": "engine-p0-dp0", "transfer_id": xfer,
                               # D waits for the KV longer than the proxy waits for P
                               "recv_timeout_ms": round(
                                   1000 * cluster.proxy.proxy.settings.deadlines.recv_s)},
    }
    assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"] == "req-42"


async def test_request_id_generated_and_transfer_ids_fresh(cluster: Cluster) -> None:
    for _ in range(2):
        async with cluster.http.post(f"{cluster.url}/v1/completions",
                                     json={"prompt": "x"}) as r:
            assert r.status == 200
            echoed = r.headers["X-Request-Id"]
    p, d = cluster.prefill[0].received, cluster.decode[0].received
    assert p[1].headers["X-Request-Id"] == d[1].headers["X-Request-Id"] == echoed
    # A request id of the proxy's own is a uuid4, and the transfer id carries it.
    assert p[1].kv["transfer_id"] == f"xfer-{echoed}"
    assert p[0].headers["X-Request-Id"] != p[1].headers["X-Request-Id"]
    assert p[0].kv["transfer_id"] != p[1].kv["transfer_id"]
    assert [r.kv["transfer_id"] for r in p] == [r.kv["transfer_id"] for r in d]


async def test_exact_bodies_for_a_streaming_chat(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": "hi"}]
    client = {"model": "tiny", "messages": messages, "max_completion_tokens": 64,
              "stream": True, "stream_options": {"include_usage": True}}
    async with cluster.http.post(f"{cluster.url}/v1/chat/completions", json=client) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    assert text.endswith("data: [DONE]\n\n")
    (p,), (d,) = cluster.prefill[0].received, cluster.decode[0].received
    xfer = p.kv["transfer_id"]
    assert p.path == d.path == "/v1/chat/completions"
    assert p.body == {"model": "tiny", "messages": messages, "max_completion_tokens": 1,
                      "max_tokens": 1, "stream": False,
                      "kv_transfer_params": {"do_remote_decode": True,
                                             "do_remote_prefill": False, "transfer_id": xfer}}
    assert d.body == {**client, "kv_transfer_params": {
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_bootstrap_addr": cluster.bootstraps[0].url,
        "remote_engine_id": "engine-p0-dp0", "transfer_id": xfer,
        "recv_timeout_ms": round(1000 * cluster.proxy.proxy.settings.deadlines.recv_s)}}


async def test_p_and_d_are_sent_at_the_same_time(cluster: Cluster) -> None:
    p, d = cluster.prefill[0], cluster.decode[0]
    p.delay = 1.0  # a slow prefill must not delay D's request
    task = asyncio.create_task(cluster.post())
    await d.wait_requests(1)
    assert not p.received[0].finished.is_set()
    status, _, _ = await task
    assert status == 200


async def test_streaming_is_forwarded_chunk_by_chunk(cluster: Cluster) -> None:
    d = cluster.decode[0]
    d.chunks, d.chunk_delay = 5, 0.2
    body = {"prompt": "hi", "max_tokens": 5, "stream": True}
    seen: list[tuple[bytes, int]] = []
    async with cluster.http.post(f"{cluster.url}/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: "):
                seen.append((line.strip(), d.received[0].chunks_sent))
    texts = [line for line, _ in seen]
    assert texts[-1] == b"data: [DONE]"
    assert len(texts) == 6
    # The first events reached the client while D was still producing the later ones.
    counts = [sent for _, sent in seen]
    assert counts[0] <= 2 and counts[1] <= 3
    assert counts == sorted(counts)


async def test_openai_client_streaming_chat(cluster: Cluster) -> None:
    client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True)
        parts = [c.choices[0].delta.content async for c in stream if c.choices]
        models = await client.models.list()
    finally:
        await client.close()
    assert "".join(p or "" for p in parts) == "t0 t1 t2 t3 "
    assert [m.id for m in models.data] == ["tiny"]
    assert cluster.decode[0].received[0].kv["do_remote_prefill"] is True


async def test_non_streaming_chat(cluster: Cluster) -> None:
    status, data, _ = await cluster.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert data["choices"][0]["message"]["content"] == "t0 t1 t2 t3"


async def test_unsafe_request_id_is_replaced(cluster: Cluster) -> None:
    for bad in ("x" * 300, "naïve-id"):
        async with cluster.http.post(f"{cluster.url}/v1/completions", json={"prompt": "x"},
                                     headers={"X-Request-Id": bad}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] != bad
    assert all(r.headers["X-Request-Id"] != "naïve-id" for r in cluster.prefill[0].received)
