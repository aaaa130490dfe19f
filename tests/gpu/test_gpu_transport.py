"""KV in GPU memory between two processes through Mooncake, every byte verified.

The same peers as tests/connector/test_transport.py with their caches on the GPU: vLLM 0.32's
LBHNC and BLHNC per-layer views and the legacy flash-attention layout, random block tables on
D, a GPU P into a CPU D, and writes outside D's registered memory refused.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.connector.kv_peer import KVSpec, random_table
from tests.connector.test_transport import peers, transfer_and_verify

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("layout", "max_run"), [("cpu", 6), ("interleaved", 6), ("flash", 12)]
)
def test_gpu_to_gpu_random_block_tables(layout: str, max_run: int) -> None:
    p_spec = KVSpec(layers=10, num_blocks=320, layout=layout, seed=1, device="cuda")
    d_spec = KVSpec(layers=10, num_blocks=400, layout=layout, seed=2, device="cuda")
    rng = random.Random(21)
    with peers(p_spec, d_spec) as (p, d):
        src = random_table(rng, 210, p_spec.num_blocks, max_run)
        dst = random_table(rng, 200, d_spec.num_blocks, max_run)  # a 10-block prefix hit
        result = transfer_and_verify(p, d, src, dst)
        assert result["nbytes"] == 200 * 10 * 2 * 4 * 16 * 64 * 2


def test_gpu_prefill_into_cpu_decode() -> None:
    p_spec = KVSpec(layers=6, num_blocks=128, seed=3, device="cuda")
    d_spec = KVSpec(layers=6, num_blocks=160, seed=4)
    with peers(p_spec, d_spec) as (p, d):
        transfer_and_verify(p, d, list(range(10, 50)), list(range(100, 140)))


def test_gpu_bad_destinations_write_nothing() -> None:
    p_spec = KVSpec(layers=4, num_blocks=64, seed=7, device="cuda")
    d_spec = KVSpec(layers=4, num_blocks=64, seed=8, device="cuda")
    with peers(p_spec, d_spec) as (p, d):
        status, kind, _ = p.call("write_raw", d.session, d.canary, 4096)
        assert (status, kind) == ("error", "TransferError")
        bad, canary_ok = d.call("verify", p.spec, [], [])
        assert bad == [] and canary_ok
        transfer_and_verify(p, d, [5, 6, 7], [60, 61, 62])
