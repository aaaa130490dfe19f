"""A seeded sampled request is served whole by one engine, whatever the split: vLLM seeds
one random stream per request, and a split would restart it on D after P drew the first
token (the text would differ from a plain server's). Greedy requests are split as ever."""

from __future__ import annotations

import pytest

from appliance.proxy.openai_api import batched_prompts, seeded_sampling
from tests.proxy.conftest import MakeCluster


@pytest.mark.parametrize("body,seeded", [
    ({"seed": 1234, "temperature": 0.9}, True),
    ({"seed": 1234}, True),  # vLLM's default temperature samples
    ({"seed": 0, "temperature": 1}, True),
    ({"seed": 1234, "temperature": 0}, False),  # greedy: exact split or not
    ({"temperature": 0.9}, False),  # unseeded: no stream to keep
    ({"seed": True, "temperature": 0.9}, False),
    ({"seed": "1", "temperature": 0.9}, False),  # vLLM refuses it: D's error, as ever
])
def test_which_requests_sample_with_their_own_seed(body: dict, seeded: bool) -> None:
    assert seeded_sampling(body) is seeded


@pytest.mark.parametrize("stream", [False, True])
async def test_split_always_serves_a_seeded_sampled_request_on_d_alone(
        make_cluster: MakeCluster, stream: bool) -> None:
    c = await make_cluster(split="always")
    seeded = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0.9,
              "seed": 1234, "stream": stream}
    assert (await c.post(body=seeded))[0] == 200
    assert c.prefill[0].received == []  # P not asked
    assert "kv_transfer_params" not in c.decode[0].bodies()[-1]
    assert (await c.post(body={**seeded, "temperature": 0}))[0] == 200  # greedy: split
    assert len(c.prefill[0].received) == 1
    assert c.decode[0].bodies()[-1]["kv_transfer_params"]["do_remote_prefill"] is True
    metrics = await c.metrics()
    assert 'pd_proxy_split_decisions_total{decision="local",reason="seeded"} 1.0' in metrics


@pytest.mark.parametrize("prompt,batch", [
    (["one", "two"], True), ([[1, 2], [3]], True), (["one"], False), ([1, 2, 3], False),
    ("one", False),
])
def test_which_requests_are_batches(prompt, batch: bool) -> None:
    assert batched_prompts({"prompt": prompt}) is batch


async def test_split_always_serves_a_batch_of_prompts_on_d_alone(
        make_cluster: MakeCluster) -> None:
    """vLLM runs one engine request per prompt: one transfer id cannot carry them all."""
    c = await make_cluster(split="always")
    body = {"model": "tiny", "prompt": ["hello", "world"], "max_tokens": 8, "temperature": 0}
    assert (await c.post(body=body))[0] == 200
    assert c.prefill[0].received == []
    assert "kv_transfer_params" not in c.decode[0].bodies()[-1]
    metrics = await c.metrics()
    assert 'pd_proxy_split_decisions_total{decision="local",reason="batch"} 1.0' in metrics
