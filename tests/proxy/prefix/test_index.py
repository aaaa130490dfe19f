"""The index follows an engine's events: stored chains, removals, clears, verification of
each stored block's hash, drops, and a prompt's leading cached blocks."""

from __future__ import annotations

import logging

import pytest

from appliance.proxy.prefix import hashing
from appliance.proxy.prefix.index import PrefixIndex, seq_step
from appliance.proxy.prefix.wire import AllBlocksCleared, BlockRemoved, BlockStored

SIZE = 4


def _ext(ids: list[int]) -> list[int]:
    return [hashing.external(h) for h in hashing.chain(ids, SIZE)]


def _stored(ids: list[int], skip: int = 0, **kw) -> BlockStored:
    """The event vLLM sends when it caches `ids`' full blocks after the first `skip`."""
    hashes = _ext(ids)
    parent = hashes[skip - 1] if skip else None
    return BlockStored(block_hashes=hashes[skip:], parent_block_hash=parent,
                       token_ids=ids[skip * SIZE:len(hashes) * SIZE], block_size=SIZE,
                       **{"medium": "GPU", **kw})


PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


@pytest.mark.parametrize(("last", "seq", "step"), [
    (-1, 0, "next"), (4, 5, "next"), (4, 7, "gap"), (-1, 3, "gap"), (4, 4, "old"),
    (4, 2, "old"), (9, 0, "restart"), (0, 0, "old")])
def test_seq_steps(last, seq, step):
    assert seq_step(last, seq) == step


def test_stored_chains_are_found_block_by_block():
    idx = PrefixIndex()
    src = idx.source("http://p", 0)
    idx.apply(src, 0, [_stored(PROMPT[:8])])
    idx.apply(src, 1, [_stored(PROMPT, skip=2)])  # a later request extended it
    assert idx.cached_blocks("http://p", _ext(PROMPT)) == 4
    assert idx.cached_blocks("http://p", _ext([7, *PROMPT[1:]])) == 0  # first token differs
    assert idx.cached_blocks("http://d", _ext(PROMPT)) == 0  # another node
    assert src.verified == 4 and src.mismatched == 0 and idx.block_size(["http://p"]) == SIZE
    # A removed middle block ends the prefix there.
    idx.apply(src, 2, [BlockRemoved(block_hashes=[_ext(PROMPT)[2]], medium="GPU")])
    assert idx.cached_blocks("http://p", _ext(PROMPT)) == 2
    idx.apply(src, 3, [AllBlocksCleared()])
    assert idx.cached_blocks("http://p", _ext(PROMPT)) == 0 and not idx.has_blocks()


def test_the_best_rank_counts_and_drops_forget():
    idx = PrefixIndex()
    r0, r1 = idx.source("http://d", 0), idx.source("http://d", 1)
    idx.apply(r0, 0, [_stored(PROMPT[:4])])
    idx.apply(r1, 0, [_stored(PROMPT)])
    assert idx.cached_blocks("http://d", _ext(PROMPT)) == 4
    idx.drop("http://d", "test", rank=1)
    assert idx.cached_blocks("http://d", _ext(PROMPT)) == 1
    assert r1.seq == -1 and r1.drops == 1
    idx.drop("http://d", "test")
    assert not idx.has_blocks()
    idx.remove("http://d")
    assert idx.describe() == {}


def test_an_engine_hashing_otherwise_predicts_nothing(caplog):
    idx = PrefixIndex(seed="another seed")  # the engine runs with vLLM's default
    src = idx.source("http://p", 0)
    with caplog.at_level(logging.WARNING, "appliance.proxy.prefix"):
        idx.apply(src, 0, [_stored(PROMPT)])
    assert not src.usable and src.mismatched == 1
    assert "sha256_cbor" in caplog.text
    assert idx.cached_blocks("http://p", _ext(PROMPT)) == 0


def test_blocks_the_proxy_cannot_verify_are_kept_unverified():
    idx = PrefixIndex()
    src = idx.source("http://p", 0)
    # The parent was stored before the proxy listened: the chain cannot be checked.
    idx.apply(src, 0, [_stored(PROMPT, skip=2)])
    assert src.verified == 0 and src.usable and len(src.blocks) == 2
    # Extra keys (a cache_salt) hash otherwise: not checked either.
    idx.apply(src, 1, [_stored([1] * 8, extra_keys=[["salt"], None])])
    assert src.mismatched == 0 and src.usable


def test_other_media_and_groups_are_left_out():
    idx = PrefixIndex()
    src = idx.source("http://p", 0)
    idx.apply(src, 0, [_stored(PROMPT, medium="CPU"), _stored(PROMPT, group_idx=1)])
    assert not src.blocks
