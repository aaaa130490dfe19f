"""Sender (P) and Receiver (D) worker sides on loopback: a real bootstrap sidecar, real ZMQ,
two real Mooncake engines over TCP, CPU KV caches. Every byte written is checked, and every
failure path ends in a definite state quickly (no hang, no leak)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from appliance.connector.metadata import RecvSpec, ReleaseSpec
from appliance.connector.planning.plan import Region
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel.layout import layout_to_wire
from appliance.connector.stats import TransferStats
from appliance.connector.transfers.mooncake import MooncakeTransport
from appliance.connector.transfers.receiver import Receiver
from appliance.connector.transfers.sender import Sender
from appliance.connector.transfers.transport import Transport
from appliance.connector.worker import kv_regions
from appliance.sidechannel import messages as m

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM = 4, 64, 2, 16, 32


def make_caches(fill: bool, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """vLLM's LBHNC layout: per layer [blocks, kv_heads, block, 2*head_dim], one buffer."""
    per_layer = BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(LAYERS * per_layer, generator=g) if fill
           else torch.zeros(LAYERS * per_layer)).to(device=device, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn":
            buf[i * per_layer:(i + 1) * per_layer].view(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
            for i in range(LAYERS)}


MLA_LATENT = 576  # kv_lora_rank 512 + rope 64


def make_mla_caches(fill: bool, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """vLLM's CPU MLA layout: per layer [blocks, 1, block, latent], one buffer."""
    per_layer = BLOCKS * BLOCK * MLA_LATENT
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(LAYERS * per_layer, generator=g) if fill
           else torch.zeros(LAYERS * per_layer)).to(device=device, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn":
            buf[i * per_layer:(i + 1) * per_layer].view(BLOCKS, 1, BLOCK, MLA_LATENT)
            for i in range(LAYERS)}


class Side:
    def __init__(self, caches: dict[str, torch.Tensor],
                 group_of: dict[str, int] | None = None,
                 transport: Transport | None = None) -> None:
        self.caches = caches
        self.regions, infos = kv_regions(caches, BLOCKS, group_of)
        self.transport = transport if transport is not None else MooncakeTransport()
        self.transport.start("127.0.0.1")
        from appliance.connector.planning.plan import registration_spans
        self.transport.register(registration_spans(infos))
        self.stats = TransferStats()

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        return self.caches[f"model.layers.{layer}.self_attn.attn"][block_id]


async def wait_registered(bootstrap_url: str, rank: int = 0, addr: str | None = None) -> None:
    """Until the sidecar lists a producer worker for this TP rank (at `addr`, if given)."""
    from appliance.bootstrap.client import BootstrapClient
    client = BootstrapClient(bootstrap_url)
    try:
        for _ in range(100):
            answer = await client.query()
            pps = answer["0"].worker_addr.get(str(rank)) if "0" in answer else None
            if pps and (addr is None or pps.get("0") == addr):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"tp rank {rank} never registered{f' at {addr}' if addr else ''}")
    finally:
        await client.close()


async def receiver_results(receiver: Receiver, timeout: float = 10
                           ) -> tuple[set[str], set[str]]:
    """Wait for the receiver to report something; returns (finished, failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = receiver.take_results()
        if done:
            return done, failed
        await asyncio.sleep(0.02)
    raise AssertionError("receiver reported nothing")


class Pair:
    """One producer and one consumer worker side sharing the test's event loop."""

    def __init__(self, bootstrap_url: str, device: str = "cpu", make=make_caches,
                 group_of: dict[str, int] | None = None,
                 new_transport: Callable[[], Transport] = MooncakeTransport,
                 **overrides) -> None:
        self.url = bootstrap_url
        self.p = Side(make(True, device=device), group_of, new_transport())
        self.d = Side(make(False, device=device), group_of, new_transport())
        common = {"bootstrap_addr": bootstrap_url, "host": "127.0.0.1",
                  "register_interval_s": 0.5, "send_timeout_s": 3, "recv_timeout_s": 3,
                  "cancel_grace_s": 1, **overrides}
        self.p_settings = ConnectorSettings(engine_id="p0", role="producer", **common)
        self.d_settings = ConnectorSettings(engine_id="d0", role="consumer", **common)
        self.sender = Sender(self.p_settings, self.p.transport, self.p.regions, "127.0.0.1",
                             0, 1, 0, self.p.stats)
        self.receiver: Receiver | None = None

    async def start(self) -> None:
        await self.sender.start()
        self.receiver = Receiver(self.d_settings, self.d.transport, self.d.regions,
                                 "127.0.0.1", 0, 1, self.d.stats)
        await wait_registered(self.url)

    def spec(self, transfer_id: str, blocks: list[int]) -> RecvSpec:
        return self.spec_groups(transfer_id, [blocks])

    def spec_groups(self, transfer_id: str, groups: list[list[int]]) -> RecvSpec:
        return RecvSpec(transfer_id, groups, "p0", self.url)

    async def results(self, timeout: float = 10) -> tuple[set[str], set[str]]:
        assert self.receiver is not None
        return await receiver_results(self.receiver, timeout)

    async def finished_sending(self, timeout: float = 10) -> set[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.sender.take_finished()
            if done:
                return done
            await asyncio.sleep(0.02)
        raise AssertionError("sender reported nothing")

    def assert_copied(self, src: list[int], dst: list[int]) -> None:
        for layer in range(LAYERS):
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(self.d.block(layer, d), self.p.block(layer, s)), (layer, s, d)

    def assert_untouched(self, except_blocks: set[int] = frozenset()) -> None:
        for layer in range(LAYERS):
            for b in range(BLOCKS):
                if b not in except_blocks:
                    assert not self.d.block(layer, b).any(), (layer, b)

    async def close(self) -> None:
        await self.sender.close()
        if self.receiver is not None:
            await self.receiver.close()
        self.p.transport.close()
        self.d.transport.close()


@pytest.fixture
async def pair(bootstrap_url):
    pr = Pair(bootstrap_url)
    await pr.start()
    yield pr
    await pr.close()


async def test_push_after_prefill_then_free(pair):
    pair.sender.on_ready("p1", "x1", [[3, 4, 5, 9]], None)
    pair.receiver.on_recv("d1", pair.spec("x1", [10, 11, 12, 40]))
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([3, 4, 5, 9], [10, 11, 12, 40])
    pair.assert_untouched({10, 11, 12, 40})
    assert pair.sender.take_finished() == set()  # the scheduler still owns the request
    pair.sender.on_finished({"p1"})
    assert pair.sender.take_finished() == {"p1"}
    totals = pair.p.stats.totals
    assert totals["transfers"] == 1 and totals["failures"] == 0
    assert totals["bytes"] == 4 * LAYERS * HEADS * BLOCK * 2 * HEAD_DIM * 2


async def test_mla_latent_blocks_arrive_byte_for_byte(bootstrap_url):
    """MLA: one latent per token and layer, no heads to split; every block lands whole."""
    pr = Pair(bootstrap_url, make=make_mla_caches)
    await pr.start()
    try:
        pr.sender.on_ready("p1", "x1", [[0, 7, 8, 63]], None)
        pr.receiver.on_recv("d1", pr.spec("x1", [5, 6, 40, 62]))
        assert await pr.results() == ({"d1"}, set())
        pr.assert_copied([0, 7, 8, 63], [5, 6, 40, 62])
        pr.assert_untouched({5, 6, 40, 62})
        assert pr.p.stats.totals["bytes"] == 4 * LAYERS * BLOCK * MLA_LATENT * 2
    finally:
        await pr.close()


async def test_decode_first_then_prefill(pair):
    pair.receiver.on_recv("d1", pair.spec("x1", [7, 8]))
    await asyncio.sleep(0.3)  # D's metadata waits on P's side (docs/protocol.md step 22)
    pair.sender.on_finished  # noqa: B018 - nothing to report yet
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([1, 2], [7, 8])


async def test_decode_prefix_hit_gets_the_last_blocks(pair):
    pair.sender.on_ready("p1", "x1", [[1, 2, 3, 4]], None)
    pair.receiver.on_recv("d1", pair.spec("x1", [20, 21]))
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([3, 4], [20, 21])


async def test_aborted_prefill_fails_waiting_decode_at_once(pair):
    pair.receiver.on_recv("d1", pair.spec("x2", [5, 6]))
    await asyncio.sleep(0.3)
    start = time.monotonic()
    pair.sender.on_aborted({"x2"})
    assert await pair.results() == ({"d1"}, {"d1"})
    assert time.monotonic() - start < 1.5  # not the 3 s deadline
    pair.assert_untouched()


async def test_aborted_prefill_fails_later_decode_at_once(pair):
    pair.sender.on_aborted({"x3"})
    start = time.monotonic()
    pair.receiver.on_recv("d1", pair.spec("x3", [5]))
    assert await pair.results() == ({"d1"}, {"d1"})
    assert time.monotonic() - start < 1.5


async def test_transfer_id_seen_twice_is_rejected(pair):
    pair.sender.on_ready("p1", "x1", [[1]], None)
    pair.receiver.on_recv("d1", pair.spec("x1", [2]))
    assert await pair.results() == ({"d1"}, set())
    pair.receiver.on_recv("d2", pair.spec("x1", [30]))
    assert await pair.results() == ({"d2"}, {"d2"})
    pair.assert_untouched({2})
    # A second prefill request reusing the id is refused too, and still freed.
    pair.sender.on_ready("p2", "x1", [[4]], None)
    pair.sender.on_finished({"p1", "p2"})
    assert await pair.finished_sending() == {"p1", "p2"}


async def test_second_prefill_with_a_live_transfer_id_leaves_the_first_intact(pair):
    """A client's kv_transfer_params reused an id while the first prefill's KV still waits
    for its decode node: the second is refused and freed; the first is still sent, then freed."""
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)
    pair.sender.on_ready("p2", "x1", [[4]], None)
    pair.sender.on_finished({"p2"})
    assert await pair.finished_sending() == {"p2"}
    pair.sender.on_finished({"p1"})
    pair.receiver.on_recv("d1", pair.spec("x1", [7, 8]))
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([1, 2], [7, 8])
    assert await pair.finished_sending() == {"p1"}


async def test_prefill_preempted_before_the_pull_sends_the_recomputed_blocks(pair):
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)
    pair.sender.on_preempted({"p1"})  # blocks 1, 2 freed; the prompt is recomputed
    pair.receiver.on_recv("d1", pair.spec("x1", [7, 8]))
    await asyncio.sleep(0.3)
    assert pair.receiver.take_results() == (set(), set())  # waits for the new blocks
    pair.sender.on_ready("p1", "x1", [[3, 4]], None)
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([3, 4], [7, 8])
    pair.sender.on_finished({"p1"})
    assert await pair.finished_sending() == {"p1"}


async def test_prefill_preempted_during_the_write_fails_the_pull(pair):
    """The write read blocks that were freed under it: D must not use what arrived."""
    import threading
    fence_open = threading.Event()
    pair.sender.on_ready("p1", "x1", [[1, 2]], lambda: fence_open.wait(5))
    pair.receiver.on_recv("d1", pair.spec("x1", [7, 8]))
    t = pair.sender.by_req["p1"]
    for _ in range(100):
        if t.state.value == "transferring":
            break
        await asyncio.sleep(0.02)
    pair.sender.on_preempted({"p1"})
    fence_open.set()
    assert await pair.results() == ({"d1"}, {"d1"})
    # The recomputed prefill finds its transfer over; its blocks are still freed once.
    pair.sender.on_ready("p1", "x1", [[3, 4]], None)
    pair.sender.on_finished({"p1"})
    assert await pair.finished_sending() == {"p1"}


async def test_receive_deadline_without_prefill(pair):
    start = time.monotonic()
    pair.receiver.on_recv("d1", pair.spec("nobody", [5]))
    assert await pair.results() == ({"d1"}, {"d1"})
    assert 2.5 < time.monotonic() - start < 6
    pair.assert_untouched()


async def test_unknown_engine_fails_fast(pair):
    pair.receiver.on_recv("d1", RecvSpec("x1", [[5]], "no-such-engine", pair.url))
    assert await pair.results(2) == ({"d1"}, {"d1"})


async def test_unfetched_kv_is_freed_after_send_timeout(pair):
    pair.sender.on_ready("p1", "x9", [[1, 2]], None)
    pair.sender.on_finished({"p1"})
    assert pair.sender.take_finished() == set()
    assert await pair.finished_sending(6) == {"p1"}
    assert pair.p.stats.totals["expired"] == 1


async def test_cancel_while_waiting_frees_both_sides(pair):
    pair.receiver.on_recv("d1", pair.spec("x5", [5, 6]))
    await asyncio.sleep(0.3)
    pair.receiver.on_cancel("d1", "x5")
    done, _ = await pair.results(2)
    assert done == {"d1"}
    # The prefill finishing later finds the transfer over and frees its blocks at once.
    pair.sender.on_ready("p1", "x5", [[1, 2]], None)
    pair.sender.on_finished({"p1"})
    assert await pair.finished_sending(2) == {"p1"}
    pair.assert_untouched()


async def test_cancel_while_looking_up_the_producer_still_frees_prefill(pair):
    """Aborted before D knew P's address: D's blocks are free at once, and P, which holds
    the KV for this transfer, is told once the lookup ends (not after send_timeout_s)."""
    pair.sender.on_ready("p1", "x8", [[1, 2]], None)
    pair.sender.on_finished({"p1"})
    pair.receiver.on_recv("d1", pair.spec("x8", [5, 6]))
    pair.receiver.on_cancel("d1", "x8")  # before the lookup task has even run
    assert await pair.results(2) == ({"d1"}, {"d1"})
    assert await pair.finished_sending(1.5) == {"p1"}  # send_timeout_s is 3
    pair.assert_untouched()


async def test_cancel_after_the_pull_was_reported_reports_nothing_more(pair):
    """The abort crossed the finished pull's report: that report frees D's blocks, and a
    second one would crash vLLM's scheduler (it asserts the request still exists)."""
    pair.sender.on_ready("p1", "x3", [[1, 2]], None)
    pair.receiver.on_recv("d1", pair.spec("x3", [5, 6]))
    assert await pair.results() == ({"d1"}, set())
    pair.receiver.on_cancel("d1", "x3")
    await asyncio.sleep(0.3)
    assert pair.receiver.take_results() == (set(), set())


async def test_release_frees_prefill_blocks(pair):
    pair.sender.on_ready("p1", "x6", [[1, 2]], None)
    pair.sender.on_finished({"p1"})
    pair.receiver.on_release(ReleaseSpec("x6", "p0", pair.url))
    assert await pair.finished_sending(2) == {"p1"}
    pair.assert_untouched()


async def test_release_leaves_a_pull_already_waiting_alone(pair):
    """A release says nobody will pull; a decode node that already asked still gets the KV
    (its own cancel, not someone's release, ends its pull)."""
    pair.receiver.on_recv("d1", pair.spec("x4", [7, 8]))
    await asyncio.sleep(0.3)  # D's request is at P, waiting for the prefill
    pair.receiver.on_release(ReleaseSpec("x4", "p0", pair.url))
    await asyncio.sleep(0.3)
    pair.sender.on_ready("p1", "x4", [[1, 2]], None)
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([1, 2], [7, 8])


async def test_released_prefill_frees_blocks_and_refuses_a_late_decode(pair):
    pair.sender.on_ready("p1", "x7", [[1, 2]], None)
    pair.sender.on_finished({"p1"})
    pair.sender.on_released({"x7"})
    assert pair.sender.take_finished() == {"p1"}  # at once, not after send_timeout_s
    pair.receiver.on_recv("d1", pair.spec("x7", [5, 6]))
    done, failed = await pair.results(5)
    assert done == failed == {"d1"}  # recomputed by D, never written into
    pair.assert_untouched()


class RawDealer:
    def __init__(self, addr: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    async def ask(self, payload: bytes, timeout: float = 3) -> m.TransferResponse:
        await self.sock.send(payload)
        return m.decode_response(await asyncio.wait_for(self.sock.recv(), timeout))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def request(pair: Pair, entries, layout=True, layout_id=1, regions=None, **kw):
    return m.TransferRequest(
        engine_id="d0", host="127.0.0.1", rpc_port=pair.d.transport.rpc_port,
        layout_id=layout_id, reqs=[m.ReqEntry(*e) for e in entries],
        layout=layout_to_wire(regions or pair.d.regions) if layout else None, **kw)


@pytest.fixture
async def dealer(pair):
    d = RawDealer(pair.sender.side_channel_addr)
    yield d
    d.close()


async def test_undecodable_bytes_get_error(pair, dealer):
    resp = await dealer.ask(b"\x93garbage")
    assert resp.status is m.Status.ERROR and "invalid" in resp.message
    assert pair.p.stats.totals["failures"] == 1


async def test_blocks_outside_decode_cache_get_error_and_nothing_written(pair, dealer):
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)
    resp = await dealer.ask(m.encode_request(request(pair, [("d1", "x1", [[3, BLOCKS]])],
                                                     layout=False, layout_id=7)))
    assert resp.status is m.Status.LAYOUT_MISS  # first contact without a layout
    # With a layout: ids beyond D's declared cache are refused before anything moves.
    with pytest.raises(m.MessageError):
        m.encode_request(request(pair, [("d1", "x1", [[3, BLOCKS]])]))
    raw = msgspec.msgpack.encode(request(pair, [("d1", "x1", [[3, BLOCKS]])]))
    resp = await dealer.ask(raw)
    assert resp.status is m.Status.ERROR and "beyond" in resp.message
    pair.assert_untouched()
    # A D that lies about its cache size can only hurt its own registered memory: the
    # write past it fails and the request is reported failed.
    fake_regions = [Region(r.base_addr, r.block_stride, r.block_bytes, BLOCKS * 4)
                    for r in pair.d.regions]
    resp = await dealer.ask(m.encode_request(request(pair, [("d1", "x1", [[3, BLOCKS + 5]])],
                                                     regions=fake_regions, layout_id=8)))
    assert resp.status is m.Status.FINISH and "d1" in resp.failed


async def test_blocks_outside_prefill_cache_get_error(pair, dealer):
    pair.sender.on_ready("p1", "x1", [[1, BLOCKS + 3]], None)
    resp = await dealer.ask(m.encode_request(request(pair, [("d1", "x1", [[3, 4]])])))
    assert resp.status is m.Status.FINISH and "P" in resp.failed["d1"]
    pair.assert_untouched()


async def test_mismatched_layout_is_rejected(pair, dealer):
    wrong = [Region(r.base_addr, r.block_stride, r.block_bytes // 2, r.num_blocks)
             for r in pair.d.regions]
    resp = await dealer.ask(m.encode_request(request(pair, [("d1", "x1", [[3]])],
                                                     regions=wrong, layout_id=9)))
    assert resp.status is m.Status.ERROR and "layouts differ" in resp.message


async def test_tp_mismatch_is_rejected(pair, dealer):
    resp = await dealer.ask(m.encode_request(request(pair, [("d1", "x1", [[3]])], tp_rank=1,
                                                     tp_size=2, layout_id=10)))
    assert resp.status is m.Status.ERROR and "tp" in resp.message


async def test_no_write_after_the_decode_deadline(pair, dealer):
    """P starts no write once D's deadline (sent with the request) has passed: D may have
    given up and reused those blocks."""
    ask = asyncio.create_task(dealer.ask(m.encode_request(request(
        pair, [("d1", "x7", [[3, 4]], 300)], layout_id=11))))
    await asyncio.sleep(0.6)
    pair.sender.on_ready("p1", "x7", [[1, 2]], None)
    resp = await ask
    assert "deadline" in resp.failed["d1"]
    pair.assert_untouched()


async def test_tensor_parallel_rank_i_sends_to_rank_i(bootstrap_url):
    """TP=2 on both sides: each rank holds its own heads' KV; D's rank r pulls from P's
    rank r only, found through the sidecar even when that rank registered after the first
    lookup."""
    common = {"bootstrap_addr": bootstrap_url, "host": "127.0.0.1", "register_interval_s": 0.5,
              "send_timeout_s": 5, "recv_timeout_s": 5}
    p_settings = ConnectorSettings(engine_id="p0", role="producer", **common)
    d_settings = ConnectorSettings(engine_id="d0", role="consumer", **common)
    ps = [Side(make_caches(True, seed=10 + r)) for r in range(2)]
    ds = [Side(make_caches(False)) for _ in range(2)]
    senders = [Sender(p_settings, ps[r].transport, ps[r].regions, "127.0.0.1", r, 2, 0,
                      ps[r].stats) for r in range(2)]
    receivers = [Receiver(d_settings, ds[r].transport, ds[r].regions, "127.0.0.1", r, 2,
                          ds[r].stats) for r in range(2)]
    try:
        await senders[0].start()
        await wait_registered(bootstrap_url, 0)
        receivers[1].on_recv("d0", RecvSpec("x0", [[1]], "p0", bootstrap_url))  # rank 1 not up
        assert await receiver_results(receivers[1]) == ({"d0"}, {"d0"})
        await senders[1].start()
        await wait_registered(bootstrap_url, 1)
        # D's rank 1 must look again, not trust its first answer
        for r in range(2):
            receivers[r].on_recv("d1", RecvSpec("x1", [[10, 11]], "p0", bootstrap_url))
            senders[r].on_ready("p1", "x1", [[3, 4]], None)
        for r in range(2):
            assert await receiver_results(receivers[r]) == ({"d1"}, set()), r
            for layer in range(LAYERS):
                for s, d in ((3, 10), (4, 11)):
                    assert torch.equal(ds[r].block(layer, d), ps[r].block(layer, s))
                    assert not torch.equal(ds[r].block(layer, d), ps[1 - r].block(layer, s))
    finally:
        for side in (*senders, *receivers):
            await side.close()
        for side in (*ps, *ds):
            side.transport.close()
