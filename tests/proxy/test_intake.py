"""A client's body: nested too deeply is a 400 (the client's fault, not a 500), and one that
stalls is cut at body_timeout_s with a 408, its connection closed and counted."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest

from appliance.proxy.jsonbody import MAX_DEPTH, too_deep
from tests.proxy.conftest import Cluster, MakeCluster

LEVELS = 100_000
DEEP = {
    "arrays": b"[" * LEVELS + b"]" * LEVELS,
    "objects": b'{"a":' * LEVELS + b"1" + b"}" * LEVELS,
    "arrays, unclosed": b"[" * LEVELS,
    "objects, unclosed": b'{"a":' * LEVELS,
    "in a request": b'{"prompt": "x", "max_tokens": 1, "tools": ' + b"[" * LEVELS
                    + b"]" * LEVELS + b"}",
}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def _nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("route", ROUTES)
async def test_deep_json_is_400(cluster: Cluster, route: str) -> None:
    for name, raw in DEEP.items():
        async with cluster.http.post(f"{cluster.url}{route}", data=raw) as r:
            assert r.status == 400, name
            error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error", name
        assert "nested too deeply" in error["message"], name
    assert cluster.upstream_requests() == 0


async def test_depth_limit_in_a_request_the_decoder_takes(cluster: Cluster) -> None:
    """Just past the limit (msgspec decodes it): refused too; at the limit: served."""
    over = {"model": "tiny", "prompt": "x", "max_tokens": 1, "user": _nested(MAX_DEPTH)}
    status, body, _ = await cluster.post(body=over)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    assert cluster.upstream_requests() == 0
    at = {**over, "user": _nested(MAX_DEPTH - 1)}
    assert (await cluster.post(body=at))[0] == 200


async def test_admin_refuses_deep_json(cluster: Cluster) -> None:
    async with cluster.http.post(f"{cluster.url}/admin/drain", data=DEEP["objects"]) as r:
        assert r.status == 400


def test_too_deep_counts_levels_without_recursing() -> None:
    assert not too_deep({"a": [1, {"b": []}]}, 4)
    assert too_deep({"a": [1, {"b": []}]}, 3)
    assert too_deep(_nested(50_000), MAX_DEPTH)  # deeper than the interpreter may recurse


async def _stall(c: Cluster, path: str, sent: bytes = b'{"prompt') -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    """A request whose head announces 100 bytes of body, of which `sent` arrive."""
    url = urlsplit(c.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n".encode() + sent)
    await writer.drain()
    return reader, writer


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + " "))


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
async def test_a_stalled_body_is_cut_at_body_timeout(make_cluster: MakeCluster,
                                                     path: str) -> None:
    c = await make_cluster(body_timeout_s=1.0)
    reader, writer = await _stall(c, path)
    metrics = c.proxy.proxy.metrics
    await c.wait_for(lambda: metrics.bodies_receiving == 1)
    text = await c.metrics()
    assert _metric(text, "pd_proxy_client_bodies_receiving") == 1.0
    # The proxy answers 408 and closes the connection: the client reads to its end.
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"Connection: close" in head
    assert "body_timeout_s" in json.loads(body)["error"]["message"]
    text = await c.metrics()
    assert _metric(text, "pd_proxy_client_body_timeouts_total") == 1.0
    assert _metric(text, "pd_proxy_client_bodies_receiving") == 0.0
    assert c.upstream_requests() == 0 and c.proxy.proxy.in_flight == 0


async def test_a_slow_body_within_the_timeout_is_served(make_cluster: MakeCluster) -> None:
    c = await make_cluster(body_timeout_s=5.0)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    reader, writer = await _stall(c, "/v1/completions", body[:8])
    await asyncio.sleep(0.3)
    # Content-Length said 100: pad the JSON with spaces to it.
    writer.write(body[8:] + b" " * (100 - len(body)))
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert c.proxy.proxy.metrics.body_timeouts == 0
