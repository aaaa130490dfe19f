"""D's side-channel sockets to producer workers (appliance.connector.sidechannel.peers): a
P worker that dies and comes back (at a new port, as every restart binds one) costs D's next
pull no wait, and the dead worker's socket is closed; idle sockets close; the open set stays
bounded.
Real sidecar, ZMQ and Mooncake on loopback (test_side_channel.py's Pair)."""

from __future__ import annotations

import asyncio
import time

import pytest

from appliance.connector.sidechannel.peers import PeerView, to_close
from appliance.connector.transfers.sender import Sender
from tests.connector.test_side_channel import Pair, wait_registered


def test_to_close_picks_lost_idle_then_least_recently_used_never_busy():
    views = [PeerView("a", 100.0), PeerView("b", 50.0), PeerView("c", 99.0, lost=True),
             PeerView("d", 10.0)]
    assert sorted(to_close(views, set(), 101.0, 60, 10)) == ["c", "d"]
    assert to_close(views, {"d"}, 101.0, 60, 10) == ["c"]  # a pull waits on d
    # Past the cap: least recently used first, until `cap` are left.
    live = [v for v in views if not v.lost]
    assert to_close(live, set(), 101.0, 1000, 2) == ["d"]
    assert to_close(live, set(), 101.0, 1000, 1) == ["d", "b"]
    assert to_close(live, {"d"}, 101.0, 1000, 1) == ["b", "a"]  # busy d is kept anyway
    assert to_close([], set(), 0.0, 1, 1) == []


def _kill(sender: Sender) -> None:
    """Stop a producer worker as SIGKILL would: its socket closes, nothing deregisters."""
    for task in sender._tasks:
        task.cancel()
    assert sender._sock is not None
    sender._sock.close(0)
    sender._pool.shutdown(wait=False, cancel_futures=True)


async def _start_again(pair: Pair, bootstrap_url: str, old: Sender) -> None:
    """A new P worker in place of `old` (killed): a new port, the same engine id,
    registered at the sidecar (`old`'s sidecar client is the caller's to close)."""
    pair.sender = Sender(pair.p_settings, pair.p.transport, pair.p.regions, "127.0.0.1",
                         0, 1, 0, pair.p.stats)
    addr = await pair.sender.start()
    assert addr != old.side_channel_addr
    await wait_registered(bootstrap_url, 0, addr)


async def _restart(pair: Pair, bootstrap_url: str) -> None:
    old = pair.sender
    _kill(old)
    await _start_again(pair, bootstrap_url, old)


async def test_a_restarted_producer_costs_the_next_pull_no_wait(bootstrap_url):
    # recv_timeout_s 3: a pull sent to the dead worker's address would fail after 3 s.
    pair = Pair(bootstrap_url)
    await pair.start()
    old = pair.sender
    try:
        pair.sender.on_ready("p1", "x1", [[1, 2]], None)
        pair.receiver.on_recv("d1", pair.spec("x1", [10, 11]))
        assert await pair.results() == ({"d1"}, set())  # D knows the worker's address now
        await _restart(pair, bootstrap_url)
        before = pair.d.stats.totals["peers_closed"]
        pair.sender.on_ready("p2", "x2", [[3, 4]], None)
        start = time.monotonic()
        pair.receiver.on_recv("d2", pair.spec("x2", [20, 21]))
        assert await pair.results() == ({"d2"}, set())
        assert time.monotonic() - start < 1.5
        pair.assert_copied([3, 4], [20, 21])
        # The dead worker's socket went when its link dropped; only the live one is open.
        assert len(pair.receiver._peers) == 1
        totals = pair.d.stats.totals
        assert before == 1 and totals["peers_opened"] == 2 and totals["peers_closed"] == 1
    finally:
        await pair.close()
        await old._bootstrap.close()


@pytest.mark.parametrize("restarted", [False, True])
async def test_an_idle_socket_closes_and_the_next_pull_opens_one(bootstrap_url, restarted):
    """An idle socket closes; the next pull opens one. `restarted`: meanwhile the P worker
    restarted at a new port under the same engine id (no link event follows a socket D
    closed itself), and the next pull asks the sidecar again instead of connecting to the
    old address and waiting its deadline."""
    pair = Pair(bootstrap_url, peer_idle_s=0.4)
    await pair.start()
    old = pair.sender
    try:
        pair.sender.on_ready("p1", "x1", [[1]], None)
        pair.receiver.on_recv("d1", pair.spec("x1", [10]))
        assert await pair.results() == ({"d1"}, set())
        deadline = time.monotonic() + 5
        while len(pair.receiver._peers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(pair.receiver._peers) == 0  # closed for idleness
        if restarted:
            await _restart(pair, bootstrap_url)
        pair.sender.on_ready("p2", "x2", [[2]], None)
        start = time.monotonic()
        pair.receiver.on_recv("d2", pair.spec("x2", [20]))
        assert await pair.results() == ({"d2"}, set())
        assert time.monotonic() - start < 1.5  # not recv_timeout_s at an old address
        pair.assert_copied([2], [20])
        assert pair.d.stats.totals["peers_opened"] == 2
    finally:
        await pair.close()
        if restarted:
            await old._bootstrap.close()


async def test_a_socket_a_pull_waits_on_stays_past_its_idle_time(bootstrap_url):
    pair = Pair(bootstrap_url, peer_idle_s=0.2, recv_timeout_s=5)
    await pair.start()
    try:
        await wait_registered(bootstrap_url)
        pair.receiver.on_recv("d1", pair.spec("x1", [10]))  # P has not prefilled it yet
        await asyncio.sleep(1.0)
        assert len(pair.receiver._peers) == 1
        pair.sender.on_ready("p1", "x1", [[1]], None)  # D's request is waiting on P's side
        assert await pair.results() == ({"d1"}, set())
        pair.assert_copied([1], [10])
    finally:
        await pair.close()


async def test_a_sidecar_still_naming_a_dead_worker_is_asked_again(bootstrap_url):
    """A lookup while P restarts (D releasing a transfer, say) finds the dead worker's
    entry still at the sidecar and caches it; once the new worker has registered, the next
    pull asks again instead of waiting on the dead address until its deadline."""
    pair = Pair(bootstrap_url)
    await pair.start()
    old = pair.sender
    try:
        assert pair.receiver is not None
        pair.sender.on_ready("p1", "x1", [[1, 2]], None)
        pair.receiver.on_recv("d1", pair.spec("x1", [10, 11]))
        assert await pair.results() == ({"d1"}, set())
        _kill(old)
        for _ in range(100):  # D saw the link drop
            if pair.receiver._peers.gone(old.side_channel_addr):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the dropped link was not noticed")
        # P is down: the sidecar still names the dead worker, and D caches it again.
        assert await pair.receiver.producers.resolve(bootstrap_url, "p0") == [old.side_channel_addr]
        pair.sender = Sender(pair.p_settings, pair.p.transport, pair.p.regions, "127.0.0.1",
                             0, 1, 0, pair.p.stats)
        addr = await pair.sender.start()
        await wait_registered(bootstrap_url, 0, addr)
        pair.sender.on_ready("p2", "x2", [[3, 4]], None)
        start = time.monotonic()
        pair.receiver.on_recv("d2", pair.spec("x2", [20, 21]))
        assert await pair.results() == ({"d2"}, set())
        assert time.monotonic() - start < 1.5  # not recv_timeout_s on the dead address
        pair.assert_copied([3, 4], [20, 21])
    finally:
        await pair.close()
        await old._bootstrap.close()


async def test_a_pull_whose_worker_dies_is_held_until_another_replaces_it(bootstrap_url):
    """The worker's link drops while D waits for its KV. A dropped link is no dead worker
    (a reset flow, a front-end NIC outage while KV moves over RDMA): it may still write
    until the deadline it was sent, so D keeps the pull's blocks past cancel_grace_s. Once
    the sidecar names another worker for that engine and rank (P restarted), the old one is
    gone: the pull goes back after cancel_grace_s, not at its deadline, and D's next pull
    reaches the new worker."""
    pair = Pair(bootstrap_url, recv_timeout_s=60, cancel_grace_s=1)
    await pair.start()
    old = pair.sender
    try:
        assert pair.receiver is not None
        pair.receiver.on_recv("d1", pair.spec("x1", [10, 11]))  # P has not prefilled it
        for _ in range(100):
            inc = pair.receiver.incoming.get("d1")
            if inc is not None and inc.waiting:
                break
            await asyncio.sleep(0.02)
        _kill(old)
        with pytest.raises(AssertionError, match="reported nothing"):
            await pair.results(timeout=2.5)  # past the grace: still held
        await _start_again(pair, bootstrap_url, old)
        start = time.monotonic()
        pair.sender.on_ready("p2", "x2", [[3]], None)
        pair.receiver.on_recv("d2", pair.spec("x2", [20]))
        finished: set[str] = set()
        failed: set[str] = set()
        while finished != {"d1", "d2"}:
            done, bad = await pair.results(timeout=10)
            finished, failed = finished | done, failed | bad
        assert failed == {"d1"} and time.monotonic() - start < 5
        pair.assert_copied([3], [20])
        pair.assert_untouched({20})
    finally:
        await pair.close()
        await old._bootstrap.close()
