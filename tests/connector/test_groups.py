"""Several KV-cache groups (vLLM's hybrid allocator: full attention beside sliding-window
layers): which models are refused at start-up, which blocks each group moves, per-group
descriptors, and real sender/receiver processes moving two overlaid groups byte for byte."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from appliance.connector.planning import groups as g
from appliance.connector.planning.descriptors import build_descriptors, build_group_descriptors
from appliance.connector.planning.groups import NULL_BLOCK, KVGroup, UnsupportedModelError
from appliance.connector.planning.plan import LayoutMismatchError, Region
from appliance.connector.scheduler import PDScheduler
from appliance.connector.settings import ConnectorSettings
from tests.connector.test_side_channel import BLOCK, BLOCKS, HEAD_DIM, HEADS, Pair

# --- which models ---------------------------------------------------------------------------


def spec(kind: str, **fields):
    return type(kind, (), {"block_size": 32, **fields})()


def config(*specs, transfer=None):
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"model.layers.{i}.attn"],
                        enable_kv_transfer=True if transfer is None else transfer[i])
        for i, s in enumerate(specs)])


def test_full_mla_and_sliding_groups_are_moved():
    groups = g.kv_groups(config(spec("FullAttentionSpec"), spec("SlidingWindowSpec",
                                                                sliding_window=64),
                                spec("MLAAttentionSpec", block_size=16)))
    assert groups == [KVGroup(32), KVGroup(32, window_blocks=3), KVGroup(16)]


@pytest.mark.parametrize(("kind", "feature"), [
    ("MambaSpec", "Mamba"), ("ChunkedLocalAttentionSpec", "chunked local attention"),
    ("CrossAttentionSpec", "cross-attention"), ("SinkFullAttentionSpec", "attention-sink"),
    ("SomethingNewSpec", "this cache kind")])
def test_unsupported_groups_are_refused_by_name(kind, feature):
    with pytest.raises(UnsupportedModelError, match=f"group 1 is {kind}.*{feature}"):
        g.kv_groups(config(spec("FullAttentionSpec"), spec(kind)))


def test_groups_outside_kv_transfer_and_extra_retained_windows_are_refused():
    with pytest.raises(UnsupportedModelError, match="takes no part in KV transfer"):
        g.kv_groups(config(spec("FullAttentionSpec"), spec("FullAttentionSpec"),
                           transfer=[True, False]))
    with pytest.raises(UnsupportedModelError, match="past its sliding window"):
        g.kv_groups(config(spec("SlidingWindowSpec", sliding_window=64,
                                extra_retained_tokens=3)))


def test_every_spec_name_exists_in_vllm():
    """The names are matched as strings: a vLLM rename must fail here, not in production."""
    from vllm.v1 import kv_cache_interface as kv

    for name in (*g._FULL, *g._WINDOW, *g._FEATURE):  # noqa: SLF001
        assert hasattr(kv, name), name


def test_the_connector_refuses_at_start_up_with_the_feature_named():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from appliance.connector.facade import PDConnector

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role="kv_consumer", engine_id="d0", kv_connector_extra_config={}))
    with pytest.raises(UnsupportedModelError, match="Mamba"):
        PDConnector(vllm_config, KVConnectorRole.SCHEDULER,
                    config(spec("FullAttentionSpec"), spec("MambaSpec")))


@pytest.mark.parametrize(("window", "block", "expected"), [
    (64, 32, 3), (65, 32, 4), (1, 16, 2), (4096, 16, 257)])
def test_window_blocks(window, block, expected):
    assert g.window_blocks(window, block) == expected


def test_needed_blocks():
    full, window = KVGroup(32), KVGroup(32, window_blocks=3)
    assert full.needed([4, 5, 6, 7]) == [4, 5, 6, 7]
    assert window.needed([NULL_BLOCK, NULL_BLOCK, 5, 6, 7]) == [5, 6, 7]
    assert window.needed([NULL_BLOCK, 6, 7]) == [6, 7]  # short prompt: no placeholder moved
    assert window.needed([1, 2]) == [1, 2]
    assert full.needed([4, 5, 6, 7], tokens=65) == [4, 5, 6]  # the blocks the prompt fills
    assert window.needed([1, 2, 3, 4, 5], tokens=64) == [1, 2]
    with pytest.raises(ValueError, match="2 KV-cache groups"):
        g.needed_blocks([full], [[1], [2]])


# --- the scheduler's lists --------------------------------------------------------------------


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Blocks:
    groups: list[list[int]]  # as vLLM's KVCacheBlocks: null placeholders included
    hashed: list[int] = field(default_factory=lambda: [0, 0])

    def get_block_ids(self):
        return tuple(self.groups)

    def get_unhashed_block_ids_all_groups(self):
        return [[b for b in ids[h:] if b != NULL_BLOCK]
                for ids, h in zip(self.groups, self.hashed, strict=True)]


GROUPS = [KVGroup(32), KVGroup(32, window_blocks=3)]


def test_prefill_sends_every_full_block_and_only_the_windows_blocks():
    s = PDScheduler(ConnectorSettings(engine_id="p0", role="producer"), GROUPS)
    req = Req("p1", list(range(200)), {"do_remote_decode": True, "transfer_id": "x1"})
    s.update_state_after_alloc(req, Blocks([[], []]), 0)
    full = list(range(1, 8))  # 200 tokens: 7 blocks
    window = [NULL_BLOCK] * 3 + [20, 21, 22, 23]  # what the window left, then its blocks
    s.kv_cache_manager = SimpleNamespace(get_block_ids=lambda _: (full, window))
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"p1": 200}))
    assert meta.ready_sends["p1"] == ("x1", [full, [21, 22, 23]])


def test_decode_asks_for_the_same_positions_from_the_right():
    s = PDScheduler(ConnectorSettings(engine_id="d0", role="consumer"), GROUPS)
    params = {"do_remote_prefill": True, "transfer_id": "x1", "remote_engine_id": "p0",
              "remote_bootstrap_addr": "http://127.0.0.1:1", "remote_num_tokens": 200}
    req = Req("d1", list(range(201)), params)  # P's prompt plus P's first token
    assert s.get_num_new_matched_tokens(req, 0) == (201, True)
    blocks = Blocks([list(range(40, 47)),  # 201 tokens: 7 blocks, all P's
                     [NULL_BLOCK] * 3 + [60, 61, 62, 63]])
    s.update_state_after_alloc(req, blocks, 201)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.recvs["d1"].block_ids == [list(range(40, 47)), [61, 62, 63]]


# --- descriptors --------------------------------------------------------------------------------


def regions(base: int, groups: list[int]) -> list[Region]:
    """One region per layer; layers of both groups overlay one allocation (as vLLM's hybrid
    allocator shares a tensor between a full and a sliding layer)."""
    return [Region(base + ((k // 2) << 20), 256, 256, 64, grp) for k, grp in enumerate(groups)]


def test_each_region_moves_its_own_groups_blocks():
    src, dst = regions(1 << 30, [0, 1, 0, 1]), regions(1 << 32, [0, 1, 0, 1])
    descs = build_group_descriptors(src, dst, [[1, 2], [9]], [[5, 6], [30]])
    full = build_descriptors([src[0], src[2]], [dst[0], dst[2]], [1, 2], [5, 6])
    window = build_descriptors([src[1], src[3]], [dst[1], dst[3]], [9], [30])
    def triples(d):
        return list(zip(d.srcs, d.dsts, d.lengths, strict=True))

    assert sorted(triples(descs)) == sorted(triples(full) + triples(window))


def test_group_mismatches_are_refused():
    src = regions(1 << 30, [0, 1])
    with pytest.raises(LayoutMismatchError, match="group"):
        build_group_descriptors(src, regions(1 << 32, [1, 0]), [[1], [2]], [[1], [2]])
    with pytest.raises(LayoutMismatchError, match="2 KV-cache groups, D 1"):
        build_group_descriptors(src, regions(1 << 32, [0, 1]), [[1], [2]], [[1]])
    with pytest.raises(LayoutMismatchError, match="block ids for 1 groups"):
        build_group_descriptors(src, regions(1 << 32, [0, 1]), [[1]], [[1]])


# --- real sender and receiver ---------------------------------------------------------------


def make_hybrid_caches(fill: bool, seed: int = 0, device: str = "cpu"):
    """Four layers, alternately sliding (group 1) and full (group 0); each pair shares one
    tensor, as vLLM's hybrid allocator lays them out."""
    per_tensor = BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(2 * per_tensor, generator=gen) if fill
           else torch.zeros(2 * per_tensor)).to(device=device, dtype=torch.bfloat16)
    views = [buf[t * per_tensor:(t + 1) * per_tensor].view(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
             for t in range(2)]
    return {f"model.layers.{i}.self_attn.attn": views[i // 2] for i in range(4)}


HYBRID_GROUPS = {f"model.layers.{i}.self_attn.attn": 1 - i % 2 for i in range(4)}


async def test_two_groups_overlaying_one_tensor_arrive_byte_for_byte(bootstrap_url):
    pr = Pair(bootstrap_url, make=make_hybrid_caches, group_of=HYBRID_GROUPS)
    await pr.start()
    try:
        assert sorted({r.group for r in pr.p.regions}) == [0, 1]
        pr.sender.on_ready("p1", "x1", [[1, 2, 3], [40, 41]], None)
        pr.receiver.on_recv("d1", pr.spec_groups("x1", [[5, 6, 7], [50, 51]]))
        assert await pr.results() == ({"d1"}, set())
        # Each tensor is one full layer's and one sliding layer's: both groups' blocks.
        for tensor in (0, 2):
            for s, d in zip([1, 2, 3, 40, 41], [5, 6, 7, 50, 51], strict=True):
                assert torch.equal(pr.d.block(tensor, d), pr.p.block(tensor, s)), (s, d)
        pr.assert_untouched({5, 6, 7, 50, 51})
        assert pr.p.stats.totals["bytes"] == 5 * 2 * HEADS * BLOCK * 2 * HEAD_DIM * 2
    finally:
        await pr.close()
