"""P and D of different TP sizes, with real senders and receivers (one per rank) over real
ZMQ and Mooncake TCP and a real bootstrap sidecar: each decode rank gets exactly its heads
from the prefill ranks holding them, every byte checked, and P frees a prompt's blocks only
once every decode rank pulling from it was served."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
import torch

from appliance.connector.metadata import RecvSpec
from appliance.connector.planning.tpplan import rank_heads
from appliance.connector.settings import ConnectorSettings
from appliance.connector.transfers.receiver import Receiver
from appliance.connector.transfers.sender import Sender
from appliance.connector.worker import kv_regions
from tests.connector.test_side_channel import (
    BLOCK,
    BLOCKS,
    HEAD_DIM,
    Side,
    receiver_results,
    wait_registered,
)

LAYERS, TOTAL_HEADS = 2, 4


def caches(heads: range, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM's CPU pages for one rank holding `heads`: [blocks, heads, block, 2*head_dim]
    per layer. When filled, head h of block b of layer l is a pattern of (l, b, h) alone,
    so whichever rank holds a head, its bytes are the same."""
    out = {}
    for layer in range(LAYERS):
        t = torch.zeros(BLOCKS, len(heads), BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
        if fill:
            for i, h in enumerate(heads):
                g = torch.Generator().manual_seed(layer * 1000 + h)
                t[:, i] = torch.randn(BLOCKS, BLOCK, 2 * HEAD_DIM, generator=g)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


class RankSide(Side):
    def __init__(self, rank: int, tp: int, fill: bool, total: int = TOTAL_HEADS) -> None:
        # MLA (total 0): one latent per token, the same on every rank.
        self.heads = rank_heads(rank, tp, total) if total else range(1)
        super().__init__(caches(self.heads, fill))
        self.regions, _ = kv_regions(self.caches, BLOCKS, None, len(self.heads))

    def head(self, layer: int, block: int, head: int) -> torch.Tensor:
        return self.caches[f"model.layers.{layer}.self_attn.attn"][block,
                                                                   head - self.heads.start]


def settings(url: str, engine: str, role: str) -> ConnectorSettings:
    return ConnectorSettings(engine_id=engine, role=role, bootstrap_addr=url, host="127.0.0.1",
                             register_interval_s=0.5, send_timeout_s=3, recv_timeout_s=5,
                             cancel_grace_s=1, verify_kv="all")


@asynccontextmanager
async def tp_pair(url: str, p_tp: int, d_tp: int, total: int = TOTAL_HEADS):
    """Sides, senders and receivers of a P of `p_tp` ranks and a D of `d_tp` (a model of
    `total` KV heads, 0: MLA), closed after."""
    parts = await start_pair(url, p_tp, d_tp, total)
    try:
        yield parts
    finally:
        await close(*parts)


async def start_pair(url: str, p_tp: int, d_tp: int, total: int = TOTAL_HEADS):
    ps = [RankSide(r, p_tp, True, total) for r in range(p_tp)]
    ds = [RankSide(r, d_tp, False, total) for r in range(d_tp)]
    senders = [Sender(settings(url, "p0", "producer"), ps[r].transport, ps[r].regions,
                      "127.0.0.1", r, p_tp, 0, ps[r].stats, total_heads=total)
               for r in range(p_tp)]
    receivers = [Receiver(settings(url, "d0", "consumer"), ds[r].transport, ds[r].regions,
                          "127.0.0.1", r, d_tp, ds[r].stats, total_heads=total)
                 for r in range(d_tp)]
    for s in senders:
        await s.start()
    for r in range(p_tp):
        await wait_registered(url, r)
    return ps, ds, senders, receivers


async def close(ps, ds, senders, receivers) -> None:
    for s in senders:
        await s.close()
    for r in receivers:
        await r.close()
    for side in (*ps, *ds):
        side.transport.close()


def assert_heads_moved(ps, ds, src: list[int], dst: list[int]) -> None:
    """Every head of every decode rank's blocks equals the prefill block it came from, and
    no other block of D changed."""
    for d in ds:
        for layer in range(LAYERS):
            for h in d.heads:
                p = next(p for p in ps if h in p.heads)
                for s, b in zip(src, dst, strict=True):
                    assert torch.equal(d.head(layer, b, h), p.head(layer, s, h)), (h, s, b)
            untouched = [b for b in range(BLOCKS) if b not in dst]
            assert not d.caches[f"model.layers.{layer}.self_attn.attn"][untouched].any()


async def finished_sending(sender: Sender, within: float = 5) -> set[str]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done = sender.take_finished()
        if done:
            return done
        await asyncio.sleep(0.02)
    return set()


async def prefill_then_decode_rank_0(url: str, sender: Sender, receiver: Receiver) -> None:
    """P's prompt in blocks 5, 6 is computed and finished; decode rank 0 pulls into 20, 21."""
    sender.on_ready("p1", "x1", [[5, 6]], None)
    sender.on_finished({"p1"})
    receiver.on_recv("d1", RecvSpec("x1", [[20, 21]], "p0", url))
    assert await receiver_results(receiver) == ({"d1"}, set())


async def test_p_tp2_to_d_tp1_pulls_each_half_from_its_rank(bootstrap_url):
    async with tp_pair(bootstrap_url, 2, 1) as (ps, ds, senders, receivers):
        for s in senders:
            s.on_ready("p1", "x1", [[3, 4, 9]], None)
            s.on_finished({"p1"})
        receivers[0].on_recv("d1", RecvSpec("x1", [[10, 11, 12]], "p0", bootstrap_url))
        assert await receiver_results(receivers[0]) == ({"d1"}, set())
        assert_heads_moved(ps, ds, [3, 4, 9], [10, 11, 12])
        for s in senders:  # each prefill rank had one decode rank to serve
            assert await finished_sending(s) == {"p1"}
        half = 3 * BLOCK * 2 * HEAD_DIM * 2 * (TOTAL_HEADS // 2) * LAYERS
        assert [p.stats.totals["bytes"] for p in ps] == [half, half]
        # Both ranks' digests of their halves add up to D's of its whole blocks.
        assert ds[0].stats.totals["verified"] == 1


@pytest.mark.parametrize(("p_tp", "total", "pulled"), [(2, 0, [0]), (4, 2, [0, 2])],
                         ids=["mla-p2-d1", "replicated-heads-p4-d1"])
async def test_prefill_ranks_nobody_pulls_from_free_the_prompt_at_once(
        bootstrap_url, p_tp, total, pulled):
    """P's TP above D's: MLA's latent comes from one P rank, a replicated head from the
    first rank holding it. The other ranks computed the prompt too; vLLM frees its blocks
    only once every P worker reported, so they must report right after D's pull, not at
    send_timeout_s (3 s here)."""
    async with tp_pair(bootstrap_url, p_tp, 1, total) as (ps, ds, senders, receivers):
        for s in senders:
            s.on_ready("p1", "x1", [[3, 4]], None)
            s.on_finished({"p1"})
        receivers[0].on_recv("d1", RecvSpec("x1", [[10, 11]], "p0", bootstrap_url))
        assert await receiver_results(receivers[0]) == ({"d1"}, set())
        assert_heads_moved([ps[r] for r in pulled], ds, [3, 4], [10, 11])
        for s in senders:
            assert await finished_sending(s, within=1) == {"p1"}, s.tp_rank
        assert [r for r, p in enumerate(ps) if p.stats.totals["bytes"]] == pulled


async def test_p_tp1_to_d_tp2_serves_both_decode_ranks_then_frees(bootstrap_url):
    async with tp_pair(bootstrap_url, 1, 2) as (ps, ds, senders, receivers):
        await prefill_then_decode_rank_0(bootstrap_url, senders[0], receivers[0])
        # One decode rank served: the prompt's blocks stay held for the other.
        assert await finished_sending(senders[0], within=0.5) == set()
        receivers[1].on_recv("d1", RecvSpec("x1", [[30, 31]], "p0", bootstrap_url))
        assert await receiver_results(receivers[1]) == ({"d1"}, set())
        assert await finished_sending(senders[0]) == {"p1"}
        assert_heads_moved(ps, ds[:1], [5, 6], [20, 21])
        assert_heads_moved(ps, ds[1:], [5, 6], [30, 31])
        assert [d.stats.totals["verified"] for d in ds] == [1, 1]  # each rank its heads


async def test_a_decode_rank_that_never_asks_does_not_hold_p_forever(bootstrap_url):
    async with tp_pair(bootstrap_url, 1, 2) as (ps, ds, senders, receivers):
        await prefill_then_decode_rank_0(bootstrap_url, senders[0], receivers[0])
        start = time.monotonic()
        assert await finished_sending(senders[0], within=6) == {"p1"}  # send_timeout_s=3
        assert time.monotonic() - start < 5
        receivers[1].on_recv("d1", RecvSpec("x1", [[30, 31]], "p0", bootstrap_url))
        done, failed = await receiver_results(receivers[1])
        assert failed == {"d1"}  # too late: refused, nothing written
        assert not ds[1].caches["model.layers.0.self_attn.attn"].any()


async def test_one_prefill_rank_failing_fails_the_pull_after_both_answer(bootstrap_url):
    async with tp_pair(bootstrap_url, 2, 1) as (ps, ds, senders, receivers):
        senders[0].on_ready("p1", "x1", [[3, 4]], None)
        senders[1].on_ready("p1", "x1", [[3, BLOCKS + 7]], None)  # outside rank 1's cache
        receivers[0].on_recv("d1", RecvSpec("x1", [[10, 11]], "p0", bootstrap_url))
        assert await receiver_results(receivers[0]) == ({"d1"}, {"d1"})
