"""KV digests (appliance.connector.transfers.digest): D checks that what landed is what P
wrote before vLLM reads it, and recomputes on a mismatch.

The arithmetic first (numpy and torch agree; a sum does not depend on how a write was cut
into legs and descriptors, and catches a flipped byte, a missing or misplaced block), then
real Senders and Receivers over the in-memory transport with a write that lands corrupted:
checked, D reports the pull failed (vLLM recomputes it); unchecked, the control, D takes it.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
import time

import msgspec
import numpy as np
import pytest
import torch

from appliance.connector.planning.descriptors import build_group_descriptors
from appliance.connector.planning.plan import Region
from appliance.connector.planning.tpplan import leg_for
from appliance.connector.transfers import digest
from appliance.sidechannel import messages as m
from tests.connector.fake_transport import FakeNetwork, FakeTransport
from tests.connector.test_side_channel import Pair

HEADS, HEAD_BYTES, BLOCKS = 4, 256, 32


def memory(nbytes: int, seed: int) -> np.ndarray:
    """Random bytes (8-aligned, as a KV cache is), kept alive by the caller."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def words_at_cpu(addr: int, nbytes: int) -> torch.Tensor:
    """What `digest.device_words` gives on a GPU, over CPU memory: the torch path here."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.int64)


def head_major(buf: np.ndarray, heads: int, layers: int = 2) -> list[Region]:
    """`layers` regions of BLOCKS blocks, each block `heads` heads one after another."""
    block = heads * HEAD_BYTES
    return [Region(buf.ctypes.data + i * BLOCKS * block, block, block, BLOCKS, 0, heads)
            for i in range(layers)]


def land(src: list[Region], dst: list[Region], src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy as the transport would: the leg's descriptors, byte for byte."""
    descs = build_group_descriptors(src, dst, [src_ids], [dst_ids])
    for s, d, n in zip(descs.srcs, descs.dsts, descs.lengths, strict=True):
        ctypes.memmove(d, s, n)


def test_numpy_and_torch_sum_alike():
    buf = memory(3 * BLOCKS * 1024, 1)
    regions = [Region(buf.ctypes.data + i * 1024, 3 * 1024, 512, BLOCKS) for i in range(3)]
    slices = digest.received_slices(regions, [[0, 5, 6, 31, 2]])
    assert digest.digest_cpu(slices) == digest.digest_torch(slices, words_at_cpu)
    assert digest.digest_cpu(slices) != digest.digest_cpu(digest.received_slices(
        regions, [[0, 5, 6, 31, 3]]))


def test_unaligned_memory_gives_no_digest():
    buf = memory(BLOCKS * 100 + 8, 2)
    slices = digest.received_slices([Region(buf.ctypes.data + 4, 100, 100, BLOCKS)], [[1]])
    assert digest.digest_cpu(slices) is None
    assert digest.digest_torch(slices, words_at_cpu) is None


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_the_producers_sums_equal_the_decode_ranks_whatever_the_tp(p_tp, d_tp):
    """Each prefill rank sums the head slices it wrote into a decode rank's blocks; the
    decode rank sums its whole blocks once, and the two agree."""
    p_bufs = [memory(2 * BLOCKS * HEADS // p_tp * HEAD_BYTES, 10 + r) for r in range(p_tp)]
    d_bufs = [np.zeros(2 * BLOCKS * HEADS // d_tp * HEAD_BYTES, np.uint8) for _ in range(d_tp)]
    p_regions = [head_major(b, HEADS // p_tp) for b in p_bufs]
    d_regions = [head_major(b, HEADS // d_tp) for b in d_bufs]
    src, dst = [3, 4, 9, 10], [20, 21, 7, 0]
    for d in range(d_tp):
        sums = []
        for p in range(p_tp):
            try:
                leg = leg_for(p, p_tp, d, d_tp, HEADS, p_regions[p], d_regions[d])
            except Exception:  # noqa: BLE001 - this decode rank pulls nothing from p
                continue
            land(leg.src, leg.dst, src, dst)
            sums.append(digest.digest_cpu(digest.sent_slices(leg.src, leg.dst, [src], [dst])))
        mine = digest.received_slices(d_regions[d], [dst])
        assert digest.digest_cpu(mine) == digest.combine(sums)
        d_bufs[d][7 * HEADS // d_tp * HEAD_BYTES + 5] ^= 1  # a flipped bit in block 7
        assert digest.digest_cpu(mine) != digest.combine(sums)


def test_a_block_missing_or_in_the_wrong_place_is_caught():
    p_buf, d_buf = memory(2 * BLOCKS * HEADS * HEAD_BYTES, 3), np.zeros(
        2 * BLOCKS * HEADS * HEAD_BYTES, np.uint8)
    p, d = head_major(p_buf, HEADS), head_major(d_buf, HEADS)
    sent = digest.digest_cpu(digest.sent_slices(p, d, [[1, 2, 3]], [[5, 6, 7]]))
    land(p, d, [1, 2], [5, 6])  # block 3 never landed
    assert digest.digest_cpu(digest.received_slices(d, [[5, 6, 7]])) != sent
    land(p, d, [3], [8])  # ...or landed one block off
    assert digest.digest_cpu(digest.received_slices(d, [[5, 6, 7]])) != sent
    land(p, d, [3], [7])
    assert digest.digest_cpu(digest.received_slices(d, [[5, 6, 7]])) == sent


def test_sample_checks_one_pull_in_sixteen():
    rng = random.Random(5)
    picked = sum(digest.chosen("sample", rng) for _ in range(16_000))
    assert 800 < picked < 1200
    assert all(digest.chosen("all") for _ in range(10))
    assert not any(digest.chosen("off") for _ in range(10))


def test_digests_on_the_wire():
    top = (1 << 64) - 1
    resp = m.TransferResponse(status=m.Status.FINISH, ok=["d1"], digests={"d1": top})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(resp), type=m.TransferResponse)
    assert back.digests == {"d1": top}
    with pytest.raises(m.MessageError, match="not reported ok"):
        m.TransferResponse(status=m.Status.FINISH, failed={"d1": "x"},
                           digests={"d1": 1}).validate()


@pytest.fixture(params=["all", "off"])
async def corrupting_pair(request, bootstrap_url):
    network = FakeNetwork()
    pr = Pair(bootstrap_url, new_transport=lambda: FakeTransport(network),
              verify_kv=request.param)
    await pr.start()
    yield request.param, pr
    await pr.close()


async def test_a_write_that_landed_corrupted_is_recomputed_not_used(corrupting_pair):
    verify, pair = corrupting_pair
    assert isinstance(pair.p.transport, FakeTransport)
    pair.sender.on_ready("p0", "x0", [[1, 2]], None)  # a sound one first
    pair.receiver.on_recv("d0", pair.spec("x0", [10, 11]))
    assert await pair.results() == ({"d0"}, set())
    pair.p.transport.faults.corrupt_writes = 1
    pair.sender.on_ready("p1", "x1", [[3, 4, 5]], None)
    pair.receiver.on_recv("d1", pair.spec("x1", [20, 21, 22]))
    got = await pair.results()
    totals = pair.d.stats.totals
    if verify == "all":
        assert got == ({"d1"}, {"d1"})  # vLLM's load-failure policy recomputes it
        assert (totals["verified"], totals["digest_mismatches"]) == (1, 1)
    else:  # the control: unchecked, D would decode from these bytes
        assert got == ({"d1"}, set())
        assert (totals["verified"], totals["digest_mismatches"]) == (0, 0)
    pair.sender.on_finished({"p0", "p1"})
    assert await pair.finished_sending() == {"p0", "p1"}  # P frees either way
    assert not pair.receiver.incoming


async def test_an_abort_while_checking_fails_the_pull(bootstrap_url):
    network = FakeNetwork()
    pair = Pair(bootstrap_url, new_transport=lambda: FakeTransport(network), verify_kv="all")
    await pair.start()
    assert pair.receiver is not None
    summed = pair.receiver._digester

    def slow_digest(slices):
        time.sleep(0.5)
        return summed(slices)

    pair.receiver._digester = slow_digest
    try:
        pair.sender.on_ready("p1", "x1", [[3, 4]], None)
        pair.receiver.on_recv("d1", pair.spec("x1", [20, 21]))
        for _ in range(200):
            inc = pair.receiver.incoming.get("d1")
            if inc is not None and inc.state.value == "verifying":
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("never verifying")
        pair.receiver.on_cancel("d1", "x1")
        assert await pair.results() == ({"d1"}, {"d1"})
    finally:
        await pair.close()
