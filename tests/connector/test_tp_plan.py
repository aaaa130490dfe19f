"""Heterogeneous TP, on synthetic shapes: which prefill ranks hold a decode rank's heads,
the slices each moves, and the regions narrowed to them."""

from __future__ import annotations

import pytest

from appliance.connector.planning.descriptors import build_descriptors
from appliance.connector.planning.plan import LayoutMismatchError, PlanError, Region, TensorInfo
from appliance.connector.planning.tpplan import (
    Pull,
    head_major,
    narrow,
    pull_served_by,
    pullers_of,
    pulls_for,
    rank_heads,
    unpulled_ranks,
)


@pytest.mark.parametrize(("tp", "total", "expected"), [
    (1, 8, [range(0, 8)]),
    (2, 8, [range(0, 4), range(4, 8)]),
    (4, 2, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # GQA: heads replicated
    (8, 8, [range(i, i + 1) for i in range(8)]),
])
def test_rank_heads(tp, total, expected):
    assert [rank_heads(r, tp, total) for r in range(tp)] == expected


@pytest.mark.parametrize(("tp", "total"), [(3, 8), (4, 3), (2, 0)])
def test_rank_heads_refuses_what_does_not_split(tp, total):
    with pytest.raises(PlanError):
        rank_heads(0, tp, total)


def test_equal_tp_is_rank_to_rank_whole_blocks():
    for total in (None, 0, 8):
        assert pulls_for(1, 2, 2, total) == [Pull(1)]


def test_p1_to_d2_each_decode_rank_takes_its_half_of_the_one_prefill_rank():
    assert pulls_for(0, 2, 1, 8) == [Pull(0, p_offset=0, d_offset=0, heads=4)]
    assert pulls_for(1, 2, 1, 8) == [Pull(0, p_offset=4, d_offset=0, heads=4)]
    assert pullers_of(0, 1, 2, 8) == [0, 1]


def test_p2_to_d1_the_decode_rank_takes_both_prefill_ranks():
    assert pulls_for(0, 1, 2, 8) == [Pull(0, 0, 0, 4), Pull(1, 0, 4, 4)]
    assert pullers_of(0, 2, 1, 8) == [0] and pullers_of(1, 2, 1, 8) == [0]


def test_p4_to_d2_and_p2_to_d4():
    assert pulls_for(1, 2, 4, 8) == [Pull(2, 0, 0, 2), Pull(3, 0, 2, 2)]
    assert pulls_for(3, 4, 2, 8) == [Pull(1, 2, 0, 2)]
    assert pullers_of(1, 2, 4, 8) == [2, 3]


def test_replicated_heads_come_from_the_first_holder():
    # 2 KV heads over P TP=4: ranks 0,1 hold head 0, ranks 2,3 head 1.
    assert pulls_for(0, 1, 4, 2) == [Pull(0, 0, 0, 1), Pull(2, 0, 1, 1)]
    assert pull_served_by(1, 4, 0, 1, 2) is None
    # And to D TP=4 from P TP=1: each decode rank one head; two ranks share each.
    assert [pulls_for(r, 4, 1, 2) for r in range(4)] == [
        [Pull(0, 0, 0, 1)], [Pull(0, 0, 0, 1)], [Pull(0, 1, 0, 1)], [Pull(0, 1, 0, 1)]]


def test_mla_latent_is_pulled_whole_from_one_prefill_rank():
    assert pulls_for(0, 2, 1, 0) == [Pull(0)] and pulls_for(1, 2, 1, 0) == [Pull(0)]
    assert pulls_for(1, 2, 4, 0) == [Pull(1)]
    assert pullers_of(0, 1, 2, 0) == [0, 1]


def test_unknown_heads_pair_only_equal_tp():
    with pytest.raises(PlanError, match="KV heads are unknown"):
        pulls_for(0, 2, 1, None)


HEAD = 32 * 2 * 64 * 2  # one head of a block: 32 tokens x (K|V of 64) x bf16


def test_narrow_cuts_each_block_to_the_heads_moved():
    p = [Region(1 << 30, 8 * HEAD, 8 * HEAD, 100, heads=8)]  # P TP=1: 8 heads per block
    d = [Region(1 << 34, 4 * HEAD, 4 * HEAD, 50, heads=4)]  # D TP=2: 4
    src, dst = narrow(p, d, pulls_for(1, 2, 1, 8)[0])
    assert src == [Region((1 << 30) + 4 * HEAD, 8 * HEAD, 4 * HEAD, 100, heads=4)]
    assert dst == [Region(1 << 34, 4 * HEAD, 4 * HEAD, 50, heads=4)]
    descs = build_descriptors(src, dst, [3, 4], [7, 8])
    # P's blocks are no longer contiguous slices: one descriptor per block, each the half.
    assert descs.srcs == [(1 << 30) + 3 * 8 * HEAD + 4 * HEAD, (1 << 30) + 4 * 8 * HEAD
                          + 4 * HEAD]
    assert descs.dsts == [(1 << 34) + 7 * 4 * HEAD, (1 << 34) + 8 * 4 * HEAD]
    assert descs.lengths == [4 * HEAD, 4 * HEAD]


def test_narrow_refuses_layouts_it_cannot_slice():
    flat = [Region(1 << 30, 8 * HEAD, 8 * HEAD, 10, heads=0)]
    half = [Region(1 << 34, 4 * HEAD, 4 * HEAD, 10, heads=4)]
    with pytest.raises(LayoutMismatchError, match="not head-major"):
        narrow(flat, half, Pull(0, 4, 0, 4))
    with pytest.raises(LayoutMismatchError, match="a head is"):
        narrow([Region(1 << 30, 8 * HEAD, 8 * HEAD, 10, heads=8)],
               [Region(1 << 34, 2 * HEAD, 2 * HEAD, 10, heads=4)], Pull(0, 4, 0, 4))
    assert narrow(flat, half, Pull(0)) == (flat, half)  # whole blocks need no slicing


def test_head_major_reads_the_layout():
    # vLLM's CPU pages [blocks, heads, block, 2*head_dim]: heads outermost in a block.
    cpu = TensorInfo(1 << 30, (10, 4, 32, 128), (4 * 32 * 128, 32 * 128, 128, 1), 2)
    (region,) = cpu.regions(10, 0)
    assert head_major(cpu.shape, cpu.strides, 2, 0, 4, region.block_bytes) == 4
    # NHD pages [blocks, block, heads, head_dim]: a head is not one chunk of the block.
    nhd = TensorInfo(1 << 30, (10, 32, 4, 128), (32 * 4 * 128, 4 * 128, 128, 1), 2)
    (region,) = nhd.regions(10, 0)
    assert head_major(nhd.shape, nhd.strides, 2, 0, 4, region.block_bytes) == 0
    assert head_major(nhd.shape, nhd.strides, 2, 0, 1, region.block_bytes) == 1


def test_unpulled_ranks_are_those_no_decode_rank_asks():
    assert unpulled_ranks(2, 1, 0) == [1]  # MLA: decode rank 0 pulls from prefill rank 0
    assert unpulled_ranks(4, 2, 0) == [2, 3]
    assert unpulled_ranks(4, 1, 2) == [1, 3]  # heads 0, 0, 1, 1: the first of each
    assert unpulled_ranks(2, 1, 4) == []  # each prefill rank holds half D's heads
    assert unpulled_ranks(1, 2, 4) == [] and unpulled_ranks(2, 2, 4) == []
