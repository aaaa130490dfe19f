"""/tokenize, /detokenize, /version (and /v1/models) answered by a decode node as it answers
them: the node's key upstream, the client's X-Request-Id kept, OpenAI-style errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.proxy.conftest import Cluster, MakeCluster


async def _call(c: Cluster, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any, Mapping[str, str]]:
    method = c.http.get if body is None else c.http.post
    kwargs: dict[str, Any] = {} if body is None else {"json": body}
    async with method(f"{c.url}{path}", headers=headers, **kwargs) as r:
        return r.status, await r.json(content_type=None), r.headers.copy()


async def test_tokenize_detokenize_version_come_from_d(make_cluster: MakeCluster) -> None:
    c = await make_cluster(backend_api_key="vllm-key")
    status, got, headers = await _call(c, "/tokenize", {"model": "tiny", "prompt": "a b c"},
                                       {"X-Request-Id": "tok-1"})
    assert status == 200 and got["tokens"] == [0, 1, 2] and got["count"] == 3
    assert headers["X-Request-Id"] == "tok-1"
    status, got, headers = await _call(c, "/detokenize", {"model": "tiny", "tokens": [4, 5]})
    assert status == 200 and got == {"prompt": "w4 w5"}
    assert headers["X-Request-Id"]  # made by the proxy when the client sent none
    status, got, _ = await _call(c, "/version")
    assert status == 200 and got == {"version": "fake-d0"}
    d = c.decode[0].received
    assert [r.path for r in d] == ["/tokenize", "/detokenize", "/version"]
    assert d[0].body == {"model": "tiny", "prompt": "a b c"}
    assert d[0].headers["X-Request-Id"] == "tok-1"
    assert d[1].headers["X-Request-Id"] == headers["X-Request-Id"]
    assert all(r.headers["Authorization"] == "Bearer vllm-key" for r in d)
    assert not c.prefill[0].received
    metrics = await c.metrics()
    assert 'pd_proxy_passthrough_requests_total{route="/tokenize",status="200"} 1.0' in metrics
    # Not generation requests: the request counts (dashboards, pdctl top) do not see them.
    assert 'route="/tokenize"' not in metrics.split("pd_proxy_passthrough_requests")[0]


async def test_keys_are_asked_where_vllm_asks_them(make_cluster: MakeCluster) -> None:
    """vLLM's --api-key guards its /v1 routes only: /tokenize, /detokenize and /version
    are open there, and so here; /v1/models needs the client's key. The client's key
    never goes upstream."""
    c = await make_cluster(api_keys=["k"])
    assert (await _call(c, "/tokenize", {"prompt": "a"}))[0] == 200
    assert (await _call(c, "/version"))[0] == 200
    assert (await _call(c, "/v1/models"))[0] == 401
    assert (await _call(c, "/v1/models", headers={"Authorization": "Bearer k"}))[0] == 200
    assert all("Authorization" not in r.headers for r in c.decode[0].received)


async def test_bad_bodies_send_nothing_upstream(cluster: Cluster) -> None:
    for raw, fragment in ((b'{"prompt": ', "not valid JSON"), (b"[1, 2]", "JSON object")):
        async with cluster.http.post(f"{cluster.url}/tokenize", data=raw) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert fragment in error["message"] and error["type"] == "invalid_request_error"
            assert r.headers["X-Request-Id"]
    assert cluster.upstream_requests() == 0


async def test_d_error_reaches_the_client_as_openai_json(cluster: Cluster) -> None:
    cluster.decode[0].status = 400
    status, got, headers = await _call(cluster, "/tokenize", {"prompt": "a"},
                                       {"X-Request-Id": "bad-1"})
    assert status == 400 and got["error"]["message"] == "d0 says no"
    assert got["error"]["code"] == 400 and headers["X-Request-Id"] == "bad-1"


async def test_no_decode_node_is_503(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    c.decode[0].healthy = False
    await c.wait_for(lambda: not c.proxy.proxy.backends.ready_decode())
    for path, body in (("/tokenize", {"prompt": "a"}), ("/version", None)):
        status, got, _ = await _call(c, path, body)
        assert status == 503 and got["error"]["type"] == "service_unavailable", path
    assert not c.decode[0].received


async def test_a_silent_d_is_504(make_cluster: MakeCluster) -> None:
    c = await make_cluster(prefill_timeout_s=0.5)
    c.decode[0].hang = True
    status, got, _ = await _call(c, "/tokenize", {"prompt": "a"})
    assert status == 504 and "timed out" in got["error"]["message"]
    await c.decode[0].received[0].finished.wait()  # its call was closed
    assert c.decode[0].received[0].cancelled


async def test_an_unreachable_d_leaves_it_to_another(make_cluster: MakeCluster) -> None:
    c = await make_cluster(n_decode=2)
    await c.decode[0].stop()  # before its health checks notice: the proxy tries it first
    status, got, _ = await _call(c, "/tokenize", {"prompt": "a b"})
    assert status == 200 and got["count"] == 2
    assert [r.path for r in c.decode[1].received] == ["/tokenize"]


async def test_the_only_d_unreachable_is_502(make_cluster: MakeCluster) -> None:
    c = await make_cluster(health_interval_s=60)  # its checks never notice
    await c.decode[0].stop()
    status, got, _ = await _call(c, "/detokenize", {"tokens": [1]})
    assert status == 502 and c.decode[0].url in got["error"]["message"]
