"""`POST /v1/responses` through the proxy, against fake vLLM servers: split like a chat (P
one token, D the answer from P's KV), JSON and event streams relayed as D sent them, the
errors, and what must be served whole: a continued response where the last one was
answered, background requests, a P with several dp ranks."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from appliance.pdctl.node.status import metric_samples, sum_samples
from tests.proxy import fake_responses as fr
from tests.proxy.conftest import Cluster, MakeCluster

PATH = "/v1/responses"


def request(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "hello", "max_output_tokens": 8, "temperature": 0,
            **extra}


async def stream(c: Cluster, body: dict[str, Any]) -> tuple[int, str]:
    async with c.http.post(f"{c.url}{PATH}", json={**body, "stream": True}) as r:
        return r.status, (await r.read()).decode()


def kinds(text: str) -> list[str]:
    return [line[7:] for line in text.split("\n") if line.startswith("event: ")]


async def test_a_response_is_split_like_a_chat(cluster: Cluster,
                                              caplog: pytest.LogCaptureFixture) -> None:
    c = cluster
    caplog.set_level(logging.INFO, logger="appliance.proxy.access")
    status, data, _ = await c.post(PATH, request())
    assert status == 200
    assert data["status"] == "incomplete" and data["usage"]["output_tokens"] == 4
    assert data["output"][0]["content"][0]["text"] == "t0 t1 t2 t3"
    [p] = c.prefill[0].bodies()
    [d] = c.decode[0].bodies()
    assert p["max_output_tokens"] == 1 and p["store"] is False and p["stream"] is False
    assert "max_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert d["max_output_tokens"] == 8 and d["kv_transfer_params"]["do_remote_prefill"]
    assert d["kv_transfer_params"]["transfer_id"] == p["kv_transfer_params"]["transfer_id"]
    # The response's id is the proxy's, of vLLM's form, and the same on both legs.
    assert data["id"] == d["request_id"] == p["request_id"]
    assert d["request_id"].startswith("resp_")
    m = metric_samples(await c.metrics())
    assert sum_samples(m, "pd_proxy_requests_total", route=PATH, status="200") == 1
    assert sum_samples(m, "pd_proxy_output_tokens_sum", path="split") == 4
    xfer = p["kv_transfer_params"]["transfer_id"]
    assert f"{PATH} " in caplog.text and f"xfer={xfer} " in caplog.text
    assert "status=200 split=remote:policy" in caplog.text


async def test_a_stream_is_relayed_event_by_event(cluster: Cluster) -> None:
    c = cluster
    c.decode[0].chunk_delay = 0.02
    status, text = await stream(c, request())
    assert status == 200
    assert text.encode() == (fr.preamble("d0", c.decode[0].bodies()[0])
                             + fr.opening_item("d0")
                             + b"".join(fr.delta("d0", i) for i in range(4))
                             + fr.closing("d0", c.decode[0].bodies()[0], 4, "length"))
    assert "[DONE]" not in text and kinds(text)[-1] == "response.completed"
    assert c.prefill[0].bodies()[0]["stream"] is False
    m = metric_samples(await c.metrics())
    # Four tokens: the delta events, not the others; three gaps between them.
    assert sum_samples(m, "pd_proxy_output_tokens_sum", path="split") == 4
    assert sum_samples(m, "pd_proxy_client_itl_seconds_count", path="split") == 3
    assert sum_samples(m, "pd_proxy_client_ttft_seconds_count", path="split") == 1
    assert not sum_samples(m, "pd_proxy_upstream_errors_total")


async def test_the_openai_client_streams_a_response(cluster: Cluster) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused")
    try:
        events = [e async for e in await client.responses.create(
            model="tiny", input="hello", max_output_tokens=8, stream=True)]
    finally:
        await client.close()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == "t0 t1 t2 t3 "
    assert events[-1].type == "response.completed"


async def test_a_stream_cut_short_ends_with_an_error_event(make_cluster: MakeCluster) -> None:
    c = await make_cluster()
    c.decode[0].skip_done = True
    status, text = await stream(c, request())
    assert status == 200 and kinds(text)[-1] == "error"
    assert "ended before response.completed" in text
    c.decode[0].skip_done, c.decode[0].die_after = False, 2
    status, text = await stream(c, request())
    assert status == 200 and kinds(text)[-2:] == ["response.output_text.delta", "error"]
    assert "failed mid-stream" in text


async def test_bad_bodies_get_400_and_reach_no_node(cluster: Cluster) -> None:
    for body in ({"model": "tiny"}, {"model": "tiny", "input": []}, [1, 2]):
        status, data, _ = await cluster.post(PATH, body)
        assert status == 400 and data["error"]["type"] == "invalid_request_error"
        assert "'input'" in data["error"]["message"] or "object" in data["error"]["message"]
    assert cluster.upstream_requests() == 0


async def test_ps_refusal_reaches_the_client(cluster: Cluster) -> None:
    c = cluster
    c.prefill[0].status = 400
    status, data, _ = await c.post(PATH, request())
    assert status == 400 and "p0 says no" in data["error"]["message"]


async def test_a_prefill_node_down_leaves_d_alone(make_cluster: MakeCluster) -> None:
    c = await make_cluster(health_interval_s=30.0)  # the proxy finds out by calling it
    await c.prefill[0].stop()
    status, data, _ = await c.post(PATH, request())
    assert status == 200 and data["output"][0]["content"][0]["text"] == "t0 t1 t2 t3"
    assert "kv_transfer_params" not in c.decode[0].bodies()[-1]  # asked again, alone


async def test_a_decode_node_down_is_a_502(make_cluster: MakeCluster) -> None:
    c = await make_cluster(health_interval_s=30.0, migration_limit=0)
    await c.decode[0].stop()
    status, data, _ = await c.post(PATH, request(stream=True))
    assert status == 502 and "unreachable" in data["error"]["message"], data


async def test_p_down_while_d_waits_opens_the_stream_once(make_cluster: MakeCluster) -> None:
    """D sent its opening events, then waited for P's KV; P goes down: D is asked again
    alone, and the client's stream has one opening, the second call's."""
    c = await make_cluster(prefill_timeout_s=60.0, decode_read_timeout_s=60.0)
    c.decode[0].wait_for_kv = True
    task = asyncio.create_task(stream(c, request()))
    await c.decode[0].wait_requests(1)
    await asyncio.sleep(0.1)
    c.prefill[0].healthy = False
    status, text = await asyncio.wait_for(task, 10)
    assert status == 200 and kinds(text).count("response.created") == 1
    assert kinds(text)[-1] == "response.completed" and "error" not in kinds(text)
    first, second = c.decode[0].received
    assert first.cancelled and "kv_transfer_params" not in second.body


async def test_split_never_serves_it_whole_on_d(make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="never")
    status, _, _ = await c.post(PATH, request())
    assert status == 200 and not c.prefill[0].received
    assert "kv_transfer_params" not in c.decode[0].bodies()[0]


async def test_a_continued_response_goes_to_the_node_that_answered(
        make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture) -> None:
    c = await make_cluster(n_decode=2, policy="round_robin")
    caplog.set_level(logging.INFO, logger="appliance.proxy.access")
    _, first, _ = await c.post(PATH, request())
    home = next(d for d in c.decode if d.received)
    for _ in range(3):  # round robin would go elsewhere; the home serves each, whole
        status, data, _ = await c.post(PATH, request(previous_response_id=first["id"]))
        assert status == 200 and data["previous_response_id"] == first["id"]
    assert len(home.received) == 4 and len(c.prefill[0].received) == 1
    assert all("kv_transfer_params" not in b for b in home.bodies()[1:])
    m = await c.metrics()
    assert ('pd_proxy_split_decisions_total{decision="local",reason="previous_response"} 3.0'
            in m)
    assert caplog.text.count(f"d={home.url} status=200 split=local:previous_response") == 3


async def test_an_unknown_previous_response_is_asked_whole(cluster: Cluster) -> None:
    c = cluster
    c.decode[0].status, c.decode[0].error_body = 404, {"error": {
        "message": "Response with id 'resp_gone' not found.", "type": "invalid_request_error",
        "code": 404}}
    status, data, _ = await c.post(PATH, request(previous_response_id="resp_gone"))
    assert status == 404 and "resp_gone" in data["error"]["message"]
    assert not c.prefill[0].received  # P would not know it either


async def test_unstored_and_background_responses(cluster: Cluster) -> None:
    c = cluster
    await c.post(PATH, request(store=False))
    assert "request_id" not in c.decode[0].bodies()[0]  # vLLM names it; nothing to route
    await c.post(PATH, request(background=True))
    assert len(c.prefill[0].received) == 1  # the first only: background is served whole
    assert "kv_transfer_params" not in c.decode[0].bodies()[1]


async def test_a_prefill_with_several_dp_ranks_is_not_split(make_cluster: MakeCluster) -> None:
    """vLLM's Responses path ignores X-data-parallel-rank: P's prefill could run in an
    engine D is not told to pull from."""
    c = await make_cluster(dp_ranks=2)
    status, _, _ = await c.post(PATH, request())
    assert status == 200 and not c.prefill[0].received
    status, _, _ = await c.post("/v1/completions")
    assert status == 200 and len(c.prefill[0].received) == 1  # the others still split


async def test_first_token_mode_leaves_responses_to_the_classic_split(
        make_cluster: MakeCluster) -> None:
    c = await make_cluster(first_token_from_prefill=True)
    status, text = await stream(c, request())
    assert status == 200 and kinds(text)[-1] == "response.completed"
    [p] = c.prefill[0].bodies()
    assert "return_token_ids" not in p and p["max_output_tokens"] == 1
    assert c.decode[0].bodies()[0]["kv_transfer_params"]["do_remote_prefill"]
