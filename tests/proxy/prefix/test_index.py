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


def test_prompts_being_computed_count_as_cached_where_asked():
    """A burst on one prefix: the second prompt comes before the first one's events. The
    blocks of the prompts a node computes now count there for a lookup that asks for them,
    once per prompt, until each is done; what the events say is unchanged."""
    idx = PrefixIndex()
    src = idx.source("http://p", 0)
    idx.apply(src, 0, [_stored(PROMPT[:4])])  # one block known from the events
    hashes = _ext(PROMPT)
    idx.expect("http://p", hashes[:3])
    idx.expect("http://p", hashes[:3])  # a second prompt with the same prefix
    assert idx.cached_blocks("http://p", hashes) == 1
    assert idx.cached_blocks("http://p", hashes, expected=True) == 3
    assert idx.cached_blocks("http://d", hashes, expected=True) == 0  # another node
    idx.unexpect("http://p", hashes[:3])
    assert idx.cached_blocks("http://p", hashes, expected=True) == 3  # the other still runs
    assert idx.describe()["http://p"]["0"]["expected_blocks"] == 3
    idx.unexpect("http://p", hashes[:3])
    assert idx.cached_blocks("http://p", hashes, expected=True) == 1
    idx.unexpect("http://p", hashes[:3])  # once too often: nothing goes below zero
    idx.expect("http://p", hashes[:2])
    idx.remove("http://p")  # a node gone takes its expectations with it
    idx.source("http://p", 0)
    assert idx.cached_blocks("http://p", hashes, expected=True) == 0


async def test_a_lookup_counts_what_a_node_computes_now_but_a_pull_does_not():
    """The decision sees the blocks of a prompt in flight on P as cached there; which blocks
    D lacks (what its pull brings, appliance.proxy.ownership) is still what its events say."""
    from appliance.proxy.prefix.cache import PrefixCache

    cache = PrefixCache(None, {}, lambda: (), hashing.DEFAULT_SEED, 5.0, 1.0)  # type: ignore[arg-type]
    for node in ("http://p", "http://d"):
        cache.index.apply(cache.index.source(node, 0), 0, [_stored(PROMPT[:4])])
    body = {"model": "m", "prompt": PROMPT}
    first = await cache.lookup(body, "/v1/completions", len(PROMPT), "", ["http://p", "http://d"])
    assert first is not None and first.cached == {"http://p": SIZE, "http://d": SIZE}
    assert first.stored == first.cached and first.lacking("http://d") == first.hashes
    cache.expect("http://p", first)
    second = await cache.lookup(body, "/v1/completions", len(PROMPT), "", ["http://p", "http://d"])
    assert second is not None
    assert second.cached == {"http://p": 4 * SIZE, "http://d": SIZE}  # all but the last token
    assert second.stored == {"http://p": SIZE, "http://d": SIZE}
    assert second.lacking("http://p") == second.hashes  # P's events have not said it yet
    cache.unexpect("http://p", first)
    third = await cache.lookup(body, "/v1/completions", len(PROMPT), "", ["http://p", "http://d"])
    assert third is not None and third.cached == first.cached
    await cache.stop()


async def test_a_configured_block_size_predicts_before_the_first_event():
    """A cold node's first burst: before any engine has sent an event, a proxy told the
    block size still hashes each prompt, so the second request of a prefix sees the first
    computing it; unconfigured, nothing is predicted until an event says the size, and
    then the event's size wins over a configured one."""
    from appliance.proxy.prefix.cache import PrefixCache

    nodes = ["http://p", "http://d"]
    body = {"model": "m", "prompt": PROMPT}
    cold = PrefixCache(None, {}, lambda: (), hashing.DEFAULT_SEED, 5.0, 1.0)  # type: ignore[arg-type]
    assert await cold.lookup(body, "/v1/completions", len(PROMPT), "", nodes) is None
    cache = PrefixCache(None, {}, lambda: (), hashing.DEFAULT_SEED, 5.0, 1.0,  # type: ignore[arg-type]
                        block_size=SIZE)
    for node in nodes:  # subscribed (appliance.proxy.prefix.events), nothing heard yet
        cache.index.source(node, 0)
    first = await cache.lookup(body, "/v1/completions", len(PROMPT), "", nodes)
    assert first is not None and first.block_size == SIZE
    assert first.hashes == tuple(_ext(PROMPT)[:4]) and first.cached == {n: 0 for n in nodes}
    cache.expect("http://p", first)
    second = await cache.lookup(body, "/v1/completions", len(PROMPT), "", nodes)
    assert second is not None and second.cached == {"http://p": 4 * SIZE, "http://d": 0}
    cache.unexpect("http://p", first)
    other = list(range(500, 518))
    ext = [hashing.external(h) for h in hashing.chain(other, 2 * SIZE)]
    cache.index.apply(cache.index.source("http://d", 0), 0, [BlockStored(
        block_hashes=ext, parent_block_hash=None, token_ids=other[:len(ext) * 2 * SIZE],
        block_size=2 * SIZE, medium="GPU")])
    third = await cache.lookup({"model": "m", "prompt": other}, "/v1/completions",
                               len(other), "", nodes)
    assert third is not None and third.block_size == 2 * SIZE
    assert third.cached == {"http://p": 0, "http://d": 2 * 2 * SIZE}
    await cache.stop()
    await cold.stop()


def test_cached_and_expected_in_one_pass():
    """Events hold the first block, a prompt in flight the next two: 1 stored, 3 with it;
    a block stored after a gap in the run counts for neither."""
    idx = PrefixIndex(hashing.DEFAULT_SEED)
    src = idx.source("http://d", 0)
    hashes = [hashing.external(h) for h in hashing.chain(PROMPT, SIZE, hashing.DEFAULT_SEED)]
    idx.apply(src, 0, [_stored(PROMPT[:4])])
    idx.expect("http://d", hashes[1:3])
    assert idx.cached_and_expected("http://d", hashes) == (1, 3)
    assert idx.cached_and_expected("http://d", hashes) == (
        idx.cached_blocks("http://d", hashes), idx.cached_blocks("http://d", hashes, True))
    assert idx.cached_and_expected("http://p", hashes) == (0, 0)
