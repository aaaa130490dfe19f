"""The proxy's block hashes are vLLM's own (sha256_cbor, its NONE_HASH seed, the low 64
bits that KV events carry)."""

from __future__ import annotations

import random

import pytest

from appliance.proxy.prefix import hashing


def _vllm_chain(ids: list[int], size: int, seed: str | None, monkeypatch) -> list[int]:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    kcu.init_none_hash(sha256_cbor)
    out, parent = [], None
    for start in range(0, len(ids) - size + 1, size):
        parent = kcu.hash_block_tokens(sha256_cbor, parent, ids[start:start + size])
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("seed", [None, "0", "1234"])
@pytest.mark.parametrize("size", [16, 32])
def test_the_chain_is_vllms(seed, size, monkeypatch):
    rng = random.Random(size)
    ids = [rng.randrange(0, 150_000) for _ in range(5 * size + 7)]  # a partial last block
    mine = [hashing.external(h) for h in hashing.chain(ids, size, seed or hashing.DEFAULT_SEED)]
    assert mine == _vllm_chain(ids, size, seed, monkeypatch)
    assert len(mine) == 5


def test_short_prompts_have_no_full_block():
    assert hashing.chain([1, 2, 3], 4) == []
    assert len(hashing.chain([1, 2, 3, 4], 4)) == 1


def test_a_block_hash_depends_on_everything_before_it():
    a = hashing.chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hashing.chain([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1] and a[0] != b[0]
    assert hashing.chain([1, 2, 3, 4], 4)[0] == a[0]
