"""DP=2 on P with real vLLM: one API server in front of two engines (`--data-parallel-size
2`), each registering its own engine id and dp rank with the sidecar. The proxy picks a rank
per request and names it to P (X-data-parallel-rank) and its engine id to D, so the prefill
runs where D pulls from: every transfer moves (D's and P's logs name it), both ranks serve,
and the output is a plain server's. Without the header P's server balances by itself and D
waits on the other engine until its deadline, then recomputes (parity alone cannot see
that)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import free_port
from tests.e2e.conftest import log_text, plain_request, running_node, text_of, token_prompt
from tests.e2e.test_pd_proxy import stream_through_proxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_node(tiny_model, tmp_path_factory):
    # Both of P's engines share core 0 and D keeps core 1: D's worker spins while it
    # waits for KV, and a P rank sharing its core starves (its side channel took > 15 s).
    with running_node(tiny_model, tmp_path_factory.mktemp("dp2-node"), timeout=600,
                      proxy_port=free_port(), prefill_cpus=(0,), decode_cpus=(1,),
                      prefill_args=("--data-parallel-size", "2"),
                      prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"}) as node:
        yield node


def engine_of_workers(node) -> dict[str, str]:
    """P's worker pids -> the engine id each registered."""
    return dict(re.findall(r"\(Worker\S* pid=(\d+)\).*? engine (\S+) tp 0 registered",
                           log_text(node.prefill.log_path)))


def writer_pid(node, transfer_id: str) -> str | None:
    m = re.search(rf"\(Worker\S* pid=(\d+)\).*?sent p_req=\S+ d_req=\S+ "
                  rf"transfer={re.escape(transfer_id)} ", log_text(node.prefill.log_path))
    return m.group(1) if m else None


async def test_every_request_pulls_from_the_rank_that_prefilled_it(dp_node, plain_server):
    engines = engine_of_workers(dp_node)
    assert sorted(engines.values()) == ["prefill-0_dp0", "prefill-0_dp1"]
    served_by = []
    for i, length in enumerate((5, 40, 70, 130)):
        body = {"model": "tiny", "prompt": token_prompt(length, seed=500 + i),
                "max_tokens": 8, "temperature": 0}
        expected = await plain_request(plain_server, "/v1/completions", body)
        for stream in (False, True):
            if stream:
                rid, _, text = await stream_through_proxy(dp_node, "/v1/completions",
                                                          {**body, "stream": True})
            else:
                rid, text = await _post(dp_node, body)
            assert text == text_of(expected)
            transfer = f"xfer-{rid}"
            pid = writer_pid(dp_node, transfer)
            assert pid in engines, f"P never wrote {transfer}"
            assert re.search(rf"received d_req=\S+ transfer={re.escape(transfer)} ",
                             log_text(dp_node.decode.log_path))
            served_by.append(engines[pid])
    assert set(served_by) == {"prefill-0_dp0", "prefill-0_dp1"}
    assert "within its receive deadline" not in log_text(dp_node.decode.log_path)


async def _post(node, body: dict) -> tuple[str, str]:
    import aiohttp
    async with aiohttp.ClientSession() as http:
        async with http.post(node.spec.proxy_url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-Request-Id"], text_of(await r.json())
