"""TP=2 on both sides with real vLLM: rank i of P writes rank i's heads into rank i of D.

Greedy output through the proxy equals P's own (a TP=2 server computing alone: TP changes
the reduction order, so a TP=1 server is not the reference), and P's log shows one write
per rank for every transfer.

Needs 8 CPUs: while a request's KV waits to be sent, vLLM keeps stepping P's engine and
both its workers spin (so does D's while it waits), so on a 2-core machine the Mooncake
and side-channel threads starve and transfers miss their deadlines (measured: a 8 KiB
write took 10-50 s, and requests fell back to recomputing on D). The same rank pairing is
covered on any machine by tests/connector/test_side_channel.py
(test_tensor_parallel_rank_i_sends_to_rank_i).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import free_port
from tests.e2e.conftest import log_text, plain_request, running_node, text_of, token_prompt
from tests.e2e.test_pd_proxy import stream_through_proxy

CPUS = len(os.sched_getaffinity(0))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CPUS < 8, reason=f"TP=2 P and D need 8 CPUs, {CPUS} here")]

TP = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def tp_node(tiny_model, tmp_path_factory):
    with running_node(tiny_model, tmp_path_factory.mktemp("tp2-node"), timeout=900,
                      proxy_port=free_port(), prefill_cpus=(0, 1, 2, 3),
                      decode_cpus=(4, 5, 6, 7), prefill_args=TP, decode_args=TP,
                      extra_env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}) as node:
        # Each server binds its two ranks to cores of its own set.
        yield node


def writes(node, transfer_id: str) -> list[int]:
    """Bytes of each write P's workers logged for this transfer."""
    return [int(b) for b in re.findall(
        rf"sent p_req=\S+ d_req=\S+ transfer={re.escape(transfer_id)} blocks=\d+ bytes=(\d+)",
        log_text(node.prefill.log_path))]


@pytest.mark.parametrize("length", [5, 64, 300])
async def test_tp2_equals_a_tp2_server_alone(tp_node, length):
    body = {"model": "tiny", "prompt": token_prompt(length, seed=400 + length),
            "max_tokens": 10, "temperature": 0}
    expected = await plain_request(tp_node.spec.prefill_url, "/v1/completions", body)
    rid, _, text = await stream_through_proxy(tp_node, "/v1/completions",
                                              {**body, "stream": True})
    assert text == text_of(expected)
    sent = writes(tp_node, f"xfer-{rid}")
    assert len(sent) == 2 and sent[0] == sent[1] > 0  # each rank its half of the heads


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["p1-d2", "p2-d1"])
def hetero_node(request, tiny_model, tmp_path_factory):
    """P and D of different TP sizes (vLLM's MooncakeConnector pairs them since vllm#36869):
    each decode rank pulls its heads from the prefill ranks that hold them."""
    p_tp, d_tp = request.param
    with running_node(tiny_model, tmp_path_factory.mktemp(f"tp{p_tp}-{d_tp}-node"),
                      timeout=900, proxy_port=free_port(), prefill_cpus=(0, 1, 2, 3),
                      decode_cpus=(4, 5, 6, 7),
                      prefill_args=("--tensor-parallel-size", str(p_tp)),
                      decode_args=("--tensor-parallel-size", str(d_tp)),
                      extra_env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}) as node:
        yield node, p_tp, d_tp


@pytest.mark.parametrize("length", [5, 64, 300])
async def test_different_tp_on_p_and_d_moves_every_head(hetero_node, length):
    node, p_tp, d_tp = hetero_node
    body = {"model": "tiny", "prompt": token_prompt(length, seed=500 + length),
            "max_tokens": 10, "temperature": 0}
    # D computes every token after P's KV with its own TP: D alone is the reference.
    expected = await plain_request(node.spec.decode_url, "/v1/completions", body)
    rid, _, text = await stream_through_proxy(node, "/v1/completions", {**body, "stream": True})
    assert text == text_of(expected)
    sent = writes(node, f"xfer-{rid}")
    # P TP=1 -> D TP=2: one prefill rank writes each decode rank its half; P TP=2 -> D TP=1:
    # each prefill rank writes its half into the one decode rank. Two equal writes either way.
    assert len(sent) == 2 and sent[0] == sent[1] > 0
