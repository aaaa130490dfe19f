"""No write from P lands in a block D has given back (real Sender and Receiver, real ZMQ,
real Mooncake over TCP, as in test_side_channel).

D gives its blocks back to vLLM (which may recompute into them or hand them to another
request) only once P has answered, or once P can write nothing more: P starts no batch after
the deadline D sent (less a margin) and stops a write under way before its next batch.
Each test holds P's write open past D's deadline or its cancel and checks D's memory.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from appliance.connector.transfers.mooncake import WriteStopped
from tests.connector.test_side_channel import Pair


@pytest.fixture
async def pair(bootstrap_url):  # noqa: F811
    # D waits 1.5 s for KV, then holds its blocks at most 2 s more for P's answer; P writes
    # one descriptor per batch, so it is asked before each of many batches.
    pr = Pair(bootstrap_url, recv_timeout_s=1.5, cancel_grace_s=2.0, max_batch_descs=1)
    await pr.start()
    yield pr
    await pr.close()


async def wait_state(pair: Pair, req: str, state: str) -> None:
    for _ in range(200):
        t = pair.sender.by_req.get(req)
        if t is not None and t.state.value == state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{req} never reached {state}")


async def reported_at(pair: Pair, timeout: float = 10) -> tuple[float, set[str], set[str]]:
    """When the receiver reported, and what: (monotonic time, finished, failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = pair.receiver.take_results()
        if done:
            return time.monotonic(), done, failed
        await asyncio.sleep(0.01)
    raise AssertionError("receiver reported nothing")


class SlowEngine:
    """P's Mooncake engine with each batch write slowed down and its start time noted."""

    def __init__(self, engine, seconds: float) -> None:
        self.engine, self.seconds = engine, seconds
        self.starts: list[float] = []

    def batch_transfer_sync_write(self, session, srcs, dsts, lengths):
        self.starts.append(time.monotonic())
        time.sleep(self.seconds)
        return self.engine.batch_transfer_sync_write(session, srcs, dsts, lengths)

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def test_write_held_past_the_deadline_is_never_started(pair):
    """P's write waits (its fence) past D's deadline: D keeps its blocks until P answers,
    and P, once free, writes nothing: the deadline it was sent has passed."""
    fence_open = threading.Event()
    pair.sender.on_ready("p1", "x1", [[1, 2]], lambda: fence_open.wait(10))
    start = time.monotonic()
    pair.receiver.on_recv("d1", pair.spec("x1", [7, 8]))
    await wait_state(pair, "p1", "transferring")
    await asyncio.sleep(1.9)  # past D's 1.5 s deadline
    assert pair.receiver.take_results() == (set(), set())  # still held: P has not answered
    fence_open.set()
    at, done, failed = await reported_at(pair)
    assert (done, failed) == ({"d1"}, {"d1"})
    assert at - start < 1.5 + 1.5  # P's answer came at once, well before the bound (3.5 s)
    assert "deadline" in (pair.sender.by_req["p1"].error or "")
    pair.assert_untouched()


async def test_blocks_go_back_at_the_bound_and_p_writes_nothing_after(pair):
    """P never answers in time (its write is held for longer than D's hold bound): D gives
    the blocks back at the bound, and the write P starts after that puts nothing there."""
    fence_open = threading.Event()
    pair.sender.on_ready("p1", "x2", [[1, 2]], lambda: fence_open.wait(10))
    start = time.monotonic()
    pair.receiver.on_recv("d1", pair.spec("x2", [7, 8]))
    await wait_state(pair, "p1", "transferring")
    at, done, failed = await reported_at(pair)
    assert (done, failed) == ({"d1"}, {"d1"})
    assert 1.5 + 2.0 <= at - start < 1.5 + 2.0 + 1.5  # deadline + grace: the bound
    fence_open.set()  # vLLM may reuse D's blocks by now: P must not write into them
    await wait_state(pair, "p1", "failed")
    await asyncio.sleep(0.3)
    pair.assert_untouched()


async def test_cancel_stops_a_write_under_way_before_its_next_batch(pair):
    """D's request is aborted mid-write: P stops before the next batch and answers; D
    reports only after that answer, and no batch starts after D's report."""
    slow = SlowEngine(pair.p.transport._engine, 0.15)  # noqa: SLF001
    pair.p.transport._engine = slow  # noqa: SLF001
    blocks = list(range(1, 9))  # 4 layers x 8 scattered runs: many one-descriptor batches
    pair.sender.on_ready("p1", "x3", [blocks], None)
    pair.receiver.on_recv("d1", pair.spec("x3", [40, 30, 20, 10, 41, 31, 21, 11]))
    await wait_state(pair, "p1", "transferring")
    await asyncio.sleep(0.4)
    pair.receiver.on_cancel("d1", "x3")
    at, done, failed = await reported_at(pair)
    assert (done, failed) == ({"d1"}, {"d1"})
    assert 0 < len(slow.starts) < 32  # stopped part-way
    assert max(slow.starts) < at  # nothing started after D gave its blocks back
    error = pair.sender.by_req["p1"].error or ""
    assert "cancelled" in error and "stopped before batch" in error
    started = len(slow.starts)
    await asyncio.sleep(0.4)
    assert len(slow.starts) == started


async def test_a_write_that_completes_after_the_deadline_is_still_used(bootstrap_url):  # noqa: F811
    """P's one batch started in time and ends after D's deadline, while D holds its
    blocks: P's answer is a success, and D takes the KV instead of recomputing."""
    pair = Pair(bootstrap_url, recv_timeout_s=1.5, cancel_grace_s=2.0)
    await pair.start()
    try:
        slow = SlowEngine(pair.p.transport._engine, 1.5)  # noqa: SLF001
        pair.p.transport._engine = slow  # noqa: SLF001
        start = time.monotonic()
        pair.sender.on_ready("p1", "x4", [[1, 2]], None)
        pair.receiver.on_recv("d1", pair.spec("x4", [9, 10]))
        at, done, failed = await reported_at(pair)
        assert len(slow.starts) == 1 and slow.starts[0] - start < 0.5
        assert at - start > 1.5  # after the deadline, on P's answer
        assert (done, failed) == ({"d1"}, set())
        pair.assert_copied([1, 2], [9, 10])
    finally:
        await pair.close()


def test_transport_stops_between_batches(pair):
    """The transport asks before every batch, the first included."""
    from appliance.connector.planning.descriptors import Descriptors

    descs = Descriptors([0, 0], [0, 0], [1, 1])
    with pytest.raises(WriteStopped, match="before batch 1/2: nope"):
        pair.p.transport.write(pair.d.transport.session_id, descs, 1, lambda: "nope")
