"""TP=2 on both sides with real vLLM: rank i of P writes rank i's heads into rank i of D.

Each vLLM server runs two CPU workers (one core each); greedy output through the proxy
equals a plain server's, and P's log shows one write per rank for every transfer.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import free_port
from tests.e2e.conftest import log_text, plain_request, running_node, text_of, token_prompt
from tests.e2e.test_pd_proxy import stream_through_proxy

pytestmark = pytest.mark.slow

TP = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def tp_node(tiny_model, tmp_path_factory):
    with running_node(tiny_model, tmp_path_factory.mktemp("tp2-node"), timeout=900,
                      proxy_port=free_port(),
                      prefill_cpus=(0, 1), decode_cpus=(0, 1), prefill_args=TP,
                      decode_args=TP, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                      # Four workers share two cores here: generous deadlines.
                      connector_extra={"recv_timeout_s": 60, "send_timeout_s": 90,
                                       "cancel_grace_s": 2}) as node:
        yield node


def writes(node, transfer_id: str) -> list[int]:
    """Bytes of each write P's workers logged for this transfer."""
    return [int(b) for b in re.findall(
        rf"sent p_req=\S+ d_req=\S+ transfer={re.escape(transfer_id)} blocks=\d+ bytes=(\d+)",
        log_text(node.prefill.log_path))]


@pytest.mark.parametrize("length", [5, 64, 300])
async def test_tp2_equals_plain_server(tp_node, plain_server, length):
    body = {"model": "tiny", "prompt": token_prompt(length, seed=400 + length),
            "max_tokens": 10, "temperature": 0}
    expected = await plain_request(plain_server, "/v1/completions", body)
    rid, _, text = await stream_through_proxy(tp_node, "/v1/completions",
                                              {**body, "stream": True})
    assert text == text_of(expected)
    sent = writes(tp_node, f"xfer-{rid}")
    assert len(sent) == 2 and sent[0] == sent[1] > 0  # each rank its half of the heads
