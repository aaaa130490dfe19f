"""A transfer's failure paths: a write that fails, a slow one, a peer lost mid-write, the
replies lost.

Real Sender and Receiver, real ZMQ and sidecar, as in test_side_channel, but over the
in-memory transport (fake_transport.py): no Mooncake, and each fault when the test says.
Whatever fails, D reports the pull failed (vLLM recomputes it), never uses what partly
landed, and keeps its blocks until P can write nothing more; P frees its blocks.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.connector.fake_transport import FakeFaults, FakeNetwork, FakeTransport
from tests.connector.test_side_channel import Pair
from tests.faults.connector import dropping
from tests.faults.plan import FaultPlan, Faults

SCATTERED = list(range(1, 9))  # 4 layers x 8 runs: 32 one-descriptor batches
TARGETS = [40, 30, 20, 10, 41, 31, 21, 11]


@pytest.fixture
async def pair(bootstrap_url):
    # D waits 1.5 s for KV, then holds its blocks at most 2 s more for P's answer; P writes
    # one descriptor per batch.
    network = FakeNetwork()
    pr = Pair(bootstrap_url, new_transport=lambda: FakeTransport(network),
              recv_timeout_s=1.5, cancel_grace_s=2.0, max_batch_descs=1)
    await pr.start()
    yield pr
    await pr.close()


def p_faults(pair: Pair) -> FakeFaults:
    assert isinstance(pair.p.transport, FakeTransport)
    return pair.p.transport.faults


def p_batches(pair: Pair) -> list[float]:
    assert isinstance(pair.p.transport, FakeTransport)
    return pair.p.transport.batch_starts


async def reported_at(pair: Pair, timeout: float = 10) -> tuple[float, set[str], set[str]]:
    """When the receiver reported, and what: (monotonic time, finished, failed)."""
    done, failed = await pair.results(timeout)
    return time.monotonic(), done, failed


async def until_batches(pair: Pair, n: int) -> None:
    for _ in range(500):
        if len(p_batches(pair)) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {n} batches started")


def freed_on_p(pair: Pair, req: str) -> bool:
    pair.sender.on_finished({req})
    return pair.sender.take_finished() == {req}


async def test_a_failed_write_fails_the_pull_and_the_next_one_moves(pair):
    p_faults(pair).fail_writes = 1
    pair.sender.on_ready("p1", "x1", [[3, 4]], None)
    pair.receiver.on_recv("d1", pair.spec("x1", [10, 11]))
    assert await pair.results() == ({"d1"}, {"d1"})
    pair.assert_untouched()
    assert "injected" in (pair.sender.by_req["p1"].error or "")
    assert freed_on_p(pair, "p1")
    assert pair.p.stats.totals["failures"] == 1
    # The transport is not broken by one failed write: the next transfer moves.
    pair.sender.on_ready("p2", "x2", [[5, 6]], None)
    pair.receiver.on_recv("d2", pair.spec("x2", [12, 13]))
    assert await pair.results() == ({"d2"}, set())
    pair.assert_copied([5, 6], [12, 13])


async def test_a_write_failing_part_way_is_not_used(pair):
    """Two batches landed before the third failed: D has part of the KV, and must not
    take it for the whole."""
    p_faults(pair).fail_writes, p_faults(pair).fail_at_batch = 1, 3
    pair.sender.on_ready("p1", "x1", [SCATTERED], None)
    pair.receiver.on_recv("d1", pair.spec("x1", TARGETS))
    assert await pair.results() == ({"d1"}, {"d1"})
    assert len(p_batches(pair)) == 3
    assert "batch 3/32" in (pair.sender.by_req["p1"].error or "")


async def test_a_slow_write_that_ends_in_time_is_used(pair):
    p_faults(pair).batch_delay_s = 0.1
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)  # one run per layer: 4 batches
    pair.receiver.on_recv("d1", pair.spec("x1", [9, 10]))
    assert await pair.results() == ({"d1"}, set())
    pair.assert_copied([1, 2], [9, 10])
    assert pair.p.stats.totals["transfers"] == 1


async def test_a_write_slower_than_the_deadline_stops_and_nothing_lands_after(pair):
    """Each batch takes 0.2 s: 32 of them outlast D's 1.5 s. P starts no batch past the
    deadline it was sent (less its margin) and answers; D reports only then, and nothing
    starts after D gave its blocks back."""
    p_faults(pair).batch_delay_s = 0.2
    start = time.monotonic()
    pair.sender.on_ready("p1", "x1", [SCATTERED], None)
    pair.receiver.on_recv("d1", pair.spec("x1", TARGETS))
    at, done, failed = await reported_at(pair)
    assert (done, failed) == ({"d1"}, {"d1"})
    assert 0 < len(p_batches(pair)) < 32  # stopped part-way
    assert max(p_batches(pair)) < at
    assert at - start < 1.5 + 2.0  # on P's answer, before D's hold bound
    assert "deadline" in (pair.sender.by_req["p1"].error or "")
    started = len(p_batches(pair))
    await asyncio.sleep(0.5)
    assert len(p_batches(pair)) == started
    assert freed_on_p(pair, "p1")


async def test_a_peer_lost_mid_write_fails_the_pull(pair):
    """D's transport goes away (its process killed, the link cut) while P writes into it:
    P's next batch fails, and D, whose side channel is still there, hears of it."""
    p_faults(pair).batch_delay_s = 0.05
    pair.sender.on_ready("p1", "x1", [SCATTERED], None)
    pair.receiver.on_recv("d1", pair.spec("x1", TARGETS))
    await until_batches(pair, 2)
    pair.d.transport.close()
    assert await pair.results() == ({"d1"}, {"d1"})
    error = pair.sender.by_req["p1"].error or ""
    assert "peer down or unreachable" in error, error
    assert freed_on_p(pair, "p1")


async def test_lost_replies_end_the_pull_at_the_hold_bound(pair):
    """Every reply P sends is lost on the way (tests.faults' drop, on D's side channel):
    the KV landed, but D never hears so, gives up at its deadline, and its blocks go back
    once P can write nothing more (deadline + cancel_grace_s), the pull failed."""
    lose_all = Faults(FaultPlan(reply_drop=1))
    pair.receiver.on_response = dropping(lose_all, pair.receiver.on_response)
    start = time.monotonic()
    pair.sender.on_ready("p1", "x1", [[3, 4]], None)
    pair.receiver.on_recv("d1", pair.spec("x1", [10, 11]))
    at, done, failed = await reported_at(pair)
    assert (done, failed) == ({"d1"}, {"d1"})
    assert 1.5 + 2.0 <= at - start < 1.5 + 2.0 + 1.0
    assert lose_all.injected["reply_drop"] >= 2  # the FINISH, then the cancel's answer
