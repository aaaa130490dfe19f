"""Bad inputs (nothing sent upstream), auth, /v1/models, /status, /metrics, the CLI."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
import pytest

from tests.conftest import ROOT, free_port
from tests.proxy.conftest import Cluster, MakeCluster


async def _raw_post(c: Cluster, path: str, data: bytes,
                    headers: dict[str, str] | None = None) -> tuple[int, dict]:
    async with c.http.post(f"{c.url}{path}", data=data,
                           headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize(("path", "data", "status", "fragment"), [
    ("/v1/completions", b'{"prompt": "x",', 400, "not valid JSON"),
    ("/v1/completions", b'"just a string"', 400, "JSON object"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "'prompt'"),
    ("/v1/chat/completions", b'{"model": "tiny", "prompt": "x"}', 400, "'messages'"),
    ("/v1/embeddings", b'{"input": "x"}', 404, "no route"),
    ("/nope", b"{}", 404, "no route"),
])
async def test_bad_inputs_send_nothing_upstream(make_cluster: MakeCluster, path: str,
                                                data: bytes, status: int, fragment: str) -> None:
    c = await make_cluster()
    got, body = await _raw_post(c, path, data)
    assert got == status
    assert fragment in body["error"]["message"]
    assert body["error"]["code"] == status and body["error"]["type"]
    assert c.upstream_requests() == 0


async def test_body_over_limit_is_413(make_cluster: MakeCluster) -> None:
    c = await make_cluster(max_body_bytes=2048)
    big = json.dumps({"prompt": "x" * 4096}).encode()
    status, body = await _raw_post(c, "/v1/completions", big)
    assert status == 413 and "too large" in body["error"]["message"]
    # Also when the client does not announce a length (chunked upload).
    async def chunks():  # noqa: ANN202
        for i in range(0, len(big), 512):
            yield big[i:i + 512]
    async with c.http.post(f"{c.url}/v1/completions", data=chunks()) as r:
        assert r.status == 413
    assert c.upstream_requests() == 0


async def test_wrong_method_is_405(cluster: Cluster) -> None:
    async with cluster.http.get(f"{cluster.url}/v1/completions") as r:
        assert r.status == 405
        assert (await r.json())["error"]["code"] == 405


async def test_api_keys(make_cluster: MakeCluster) -> None:
    c = await make_cluster(api_keys=["k-one", "k-two"])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"},
                    {"Authorization": "Basic k-one"}):
        status, data, _ = await c.post(headers=headers)
        assert status == 401 and data["error"]["type"] == "authentication_error"
    assert c.upstream_requests() == 0
    for key in ("k-one", "k-two"):
        status, _, _ = await c.post(headers={"Authorization": f"Bearer {key}"})
        assert status == 200
    # The client's key is the proxy's business: it never reaches P or D.
    assert all("Authorization" not in r.headers
               for n in [*c.prefill, *c.decode] for r in n.received)
    async with c.http.get(f"{c.url}/v1/models") as r:
        assert r.status == 401
    for path in ("/health", "/metrics", "/status"):
        async with c.http.get(f"{c.url}{path}") as r:
            assert r.status == 200, path


async def test_api_keys_on_ops_endpoints(make_cluster: MakeCluster) -> None:
    c = await make_cluster(api_keys=["k"], auth_ops_endpoints=True, ready=False)
    async with c.http.get(f"{c.url}/health") as r:
        assert r.status == 503  # open: it says only whether the node is ready
    for path in ("/metrics", "/status"):
        async with c.http.get(f"{c.url}{path}") as r:
            assert r.status == 401, path
        async with c.http.get(f"{c.url}{path}", headers={"Authorization": "Bearer k"}) as r:
            assert r.status in (200, 503), path


async def test_backend_api_key_is_sent_upstream(make_cluster: MakeCluster) -> None:
    c = await make_cluster(backend_api_key="vllm-key")
    assert (await c.post())[0] == 200
    for n in [*c.prefill, *c.decode]:
        assert n.received[0].headers["Authorization"] == "Bearer vllm-key"
    assert "Authorization" not in c.bootstraps[0].last_headers  # not its business


async def test_bootstrap_token_is_sent_to_query(make_cluster: MakeCluster) -> None:
    c = await make_cluster(backend_api_key="vllm-key", bootstrap_token="boot-token")
    assert (await c.post())[0] == 200
    assert c.bootstraps[0].last_headers["Authorization"] == "Bearer boot-token"
    for n in [*c.prefill, *c.decode]:
        assert n.received[0].headers["Authorization"] == "Bearer vllm-key"


async def test_models_from_a_healthy_decode_node(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2)
    c.decode[0].healthy = False
    await c.wait_for(lambda: _decode_ready(c, 1))
    for _ in range(2):
        async with c.http.get(f"{c.url}/v1/models") as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["owned_by"] == "d1"


async def _decode_ready(c: Cluster, n: int) -> bool:
    async with c.http.get(f"{c.url}/health") as r:
        return (await r.json())["decode_ready"] == n


async def test_status_document(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_prefill=2, dp_ranks=2)
    st = await c.status()
    assert st["ready"] is True and st["reason"] is None
    assert st["policy"] == "cache_aware" and st["fallback_to_decode"] is True
    assert st["in_flight"] == 0
    p0 = st["prefill"][0]
    assert p0["url"] == c.prefill[0].url and p0["bootstrap_url"] == c.bootstraps[0].url
    assert p0["engine_ids"] == {"0": "engine-p0-dp0", "1": "engine-p0-dp1"}
    assert p0["healthy"] and p0["in_rotation"] and p0["in_flight"] == 0
    assert p0["last_check_age_s"] < 5
    assert st["decode"][0]["url"] == c.decode[0].url


async def test_metrics_document(cluster: Cluster) -> None:
    await cluster.post()
    await cluster.post(body={"prompt": "x", "stream": True})
    await cluster.post(body={"nope": 1})
    text = await cluster.metrics()
    assert 'pd_proxy_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert 'pd_proxy_requests_total{route="/v1/completions",status="400"} 1.0' in text
    assert "pd_proxy_requests_in_flight 0.0" in text
    assert "pd_proxy_decode_ttfb_seconds_count 2.0" in text
    assert "pd_proxy_prefill_seconds_count 2.0" in text
    assert f'pd_proxy_backend_up{{backend="{cluster.prefill[0].url}",role="prefill"}} 1.0' \
        in text


async def test_two_proxies_in_one_process_keep_their_own_metrics(
        make_cluster: MakeCluster) -> None:
    a, b = await make_cluster(), await make_cluster()
    await a.post()
    assert 'status="200"} 1.0' in await a.metrics()
    assert 'status="200"' not in await b.metrics()


async def test_cli_serves(make_cluster: MakeCluster) -> None:
    """`python -m appliance.proxy` with flags, as pdctl and users start it."""
    c = await make_cluster()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "appliance.proxy", "--host", "127.0.0.1", "--port", str(port),
        "--prefill", f"{c.prefill[0].url},{c.bootstraps[0].url}",
        "--decode", c.decode[0].url, "--health-interval", "0.1",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                async with c.http.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "proxy did not become healthy"
            await asyncio.sleep(0.1)
        async with c.http.post(f"http://127.0.0.1:{port}/v1/completions",
                               json={"prompt": "x"}, headers={"X-Request-Id": "cli-1"}) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    log = out.decode()
    assert "cli-1 xfer=xfer-" in log and "status=200" in log


async def test_cli_refuses_bad_flags() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "appliance.proxy", "--decode", "ftp://x",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"proxy: error: decode.0.url" in err
