"""KV digests over GPU memory (appliance.connector.transfers.digest): the torch reduction
reads the KV where it lies, through the CUDA array interface at raw addresses, and gives the
sum numpy gives over a host copy of the same bytes; a flipped byte changes it."""

from __future__ import annotations

import pytest
import torch

from appliance.connector.transfers import digest
from appliance.connector.worker import kv_regions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCKS = 64


def test_a_gpu_digest_equals_the_host_digest_of_the_same_bytes() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    kv = torch.randn(BLOCKS, 2, 16, 64, generator=g, device="cuda").to(torch.bfloat16)
    host = kv.cpu()
    name = "model.layers.0.self_attn.attn"
    gpu_regions, _ = kv_regions({name: kv}, BLOCKS)
    cpu_regions, _ = kv_regions({name: host}, BLOCKS)
    ids = [[3, 4, 5, 40, 63]]
    on_gpu = digest.digester_for(kv.device)(digest.received_slices(gpu_regions, ids))
    on_host = digest.digest_cpu(digest.received_slices(cpu_regions, ids))
    # The same bytes at other addresses: sum the host copy at the GPU's addresses.
    at_gpu = [digest.Slice(c.region, c.ids, g_.region, g_.ids) for c, g_ in zip(
        digest.received_slices(cpu_regions, ids), digest.received_slices(gpu_regions, ids),
        strict=True)]
    assert on_gpu == digest.digest_cpu(at_gpu) and on_gpu != on_host
    kv.view(torch.uint8).view(-1)[40 * kv[0].numel() * 2 + 7] ^= 1  # block 40
    torch.cuda.synchronize()
    assert digest.digester_for(kv.device)(digest.received_slices(gpu_regions, ids)) != on_gpu
