"""What the client felt, by path: TTFT (streams), ITL between streamed tokens, end to end,
admission wait, prompt and output tokens, and the serving node's leg."""

from __future__ import annotations

import pytest

from appliance.pdctl.node.status import metric_samples, sum_samples
from appliance.proxy.exchange.relay import token_events
from appliance.proxy.metrics import ProxyMetrics
from tests.proxy.conftest import Cluster, MakeCluster


def _count(text: str, name: str, **labels: str) -> float:
    return sum_samples(metric_samples(text), f"{name}_count", **labels) or 0.0


def _sum(text: str, name: str, **labels: str) -> float:
    return sum_samples(metric_samples(text), f"{name}_sum", **labels) or 0.0


async def _stream(c: Cluster, route: str = "/v1/completions") -> str:
    body = ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            if route.endswith("chat/completions") else {"model": "tiny", "prompt": "hi"})
    async with c.http.post(f"{c.url}{route}", json={**body, "max_tokens": 8,
                                                     "stream": True}) as r:
        assert r.status == 200
        return (await r.read()).decode()


def test_token_events_skip_done_usage_and_the_role_event() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    assert token_events(role + token + token) == 2
    assert token_events(usage + b"data: [DONE]\n\n") == 0


def test_path_histograms_export_only_the_paths_seen() -> None:
    m = ProxyMetrics()
    m.client_e2e.observe("local", 0.2)
    m.output_tokens.observe("split", 32)
    text = m.render().decode()
    assert 'pd_proxy_client_e2e_seconds_bucket{le="0.25",path="local"} 1.0' in text
    assert 'path="split"' not in text.split("pd_proxy_output_tokens")[0]
    assert 'pd_proxy_output_tokens_bucket{le="32",path="split"} 1.0' in text


async def test_split_answers_and_streams_are_timed_as_the_client_saw_them(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    c.decode[0].chunk_delay = 0.02
    status, data, _ = await c.post()  # whole answer: usage 5 in, 4 out
    assert status == 200
    text = await _stream(c)
    assert text.count("data: ") == 5  # 4 tokens and [DONE]
    m = await c.metrics()
    assert _count(m, "pd_proxy_client_e2e_seconds", path="split") == 2
    assert _count(m, "pd_proxy_decode_leg_seconds", path="split") == 2
    # TTFT is a stream's alone: a whole answer's first byte is its last.
    assert _count(m, "pd_proxy_client_ttft_seconds", path="split") == 1
    # Four tokens streamed: three gaps between them, each after D's 20 ms pause.
    assert _count(m, "pd_proxy_client_itl_seconds", path="split") == 3
    assert _sum(m, "pd_proxy_client_itl_seconds", path="split") > 0
    assert _count(m, "pd_proxy_output_tokens", path="split") == 2
    assert _sum(m, "pd_proxy_output_tokens", path="split") == 8  # usage's 4, the stream's 4
    assert _sum(m, "pd_proxy_prompt_tokens", path="split") >= 5
    assert _count(m, "pd_proxy_admission_wait_seconds") == 2


async def test_first_token_streams_count_ps_token_and_the_gap_after_it(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True)
    await _stream(c, "/v1/chat/completions")
    m = await c.metrics()
    assert _count(m, "pd_proxy_client_ttft_seconds", path="first_token") == 1
    # P's token, then D's four: the gap from P's token to D's first is one the client felt.
    assert _sum(m, "pd_proxy_output_tokens", path="first_token") == 5
    assert _count(m, "pd_proxy_client_itl_seconds", path="first_token") == 4
    assert _count(m, "pd_proxy_client_e2e_seconds", path="split") == 0


@pytest.mark.parametrize("split,p_down,path", [
    ("never", False, "local"),
    ("always", True, "d_alone"),  # P gone: D alone, a fallback
])
async def test_one_node_paths_are_labelled_their_own(make_cluster: MakeCluster, split: str,
                                                     p_down: bool, path: str) -> None:
    c = await make_cluster(split=split)
    if p_down:
        await c.prefill[0].stop()
    await _stream(c)
    status, _, _ = await c.post()
    assert status == 200
    m = await c.metrics()
    assert _count(m, "pd_proxy_client_e2e_seconds", path=path) == 2
    assert _count(m, "pd_proxy_client_ttft_seconds", path=path) == 1
    assert _count(m, "pd_proxy_client_e2e_seconds", path="split") == 0


async def test_failed_requests_feel_no_latency(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    c.decode[0].status = 500
    status, _, _ = await c.post()
    assert status == 502
    m = await c.metrics()
    assert _count(m, "pd_proxy_client_e2e_seconds") == 0
