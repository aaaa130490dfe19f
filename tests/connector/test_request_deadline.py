"""A request's own receive deadline (appliance.deadlines, sent by the proxy) rules both
sides, whatever they were configured with (real Sender and Receiver, real ZMQ, real
Mooncake over TCP): D does not give up on KV that P is still computing, and P waits for
that prefill as long as D waits. Before, D gave up at its recv_timeout_s and recomputed
the prompt while the proxy still waited for P to compute it too."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from tests.connector.test_side_channel import Pair


async def test_a_prefill_slower_than_both_configured_waits_is_still_pulled(bootstrap_url):
    # Both sides configured to wait 1 s; the request says 6 s (the proxy's wait for P and
    # the write's allowance).
    pair = Pair(bootstrap_url, recv_timeout_s=1, send_timeout_s=1)
    await pair.start()
    try:
        assert pair.receiver is not None
        pair.receiver.on_recv("d1", replace(pair.spec("x1", [7, 8]), timeout_s=6.0))
        await asyncio.sleep(2.5)  # P's prefill (its queue) outlasts both configured waits
        assert pair.receiver.take_results() == (set(), set())
        t = pair.sender.by_transfer["x1"]
        assert not t.state.terminal  # P still waits for its prefill, for D
        pair.sender.on_ready("p1", "x1", [[1, 2]], None)
        assert await pair.results() == ({"d1"}, set())
        pair.assert_copied([1, 2], [7, 8])
    finally:
        await pair.close()


async def test_without_its_own_deadline_a_request_waits_as_configured(bootstrap_url):
    pair = Pair(bootstrap_url, recv_timeout_s=1, send_timeout_s=5, cancel_grace_s=0.5)
    await pair.start()
    try:
        assert pair.receiver is not None
        pair.receiver.on_recv("d1", pair.spec("x1", [7, 8]))
        done, failed = await pair.results()
        assert done == failed == {"d1"}  # given up at 1 s: vLLM's load-failure policy
        pair.assert_untouched()
    finally:
        await pair.close()
