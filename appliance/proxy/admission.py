"""Overload control: at most `max_in_flight_per_decode` requests in flight per decode node,
up to `max_queued` more waiting (first come, first served) at most `queue_timeout_s` for a
slot; beyond that the client gets 429 with `Retry-After` at once, never a hang. A node
that is full takes nothing more; the others still do. Off (no limit) by default.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from appliance.proxy.errors import ProxyError
from appliance.proxy.flight import Flight
from appliance.proxy.nodes.backends import Backend
from appliance.proxy.waitqueue import WaitQueue

RATE_LIMIT = "rate_limit_error"  # OpenAI's error type for a 429


class Overloaded(ProxyError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(429, message, RATE_LIMIT,
                         {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class Admission:
    def __init__(self, limit: int, max_queued: int, queue_timeout_s: float,
                 on_reject: Callable[[str], None]) -> None:
        self.limit = limit  # 0: no limit
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.on_reject = on_reject  # counted by reason: "queue_full" or "queue_timeout"
        self._queue = WaitQueue()

    @property
    def queued(self) -> int:
        return self._queue.waiting

    def _free(self, decodes: Sequence[Backend]) -> list[Backend]:
        return [d for d in decodes if d.in_flight < self.limit]

    async def admit(self, flight: Flight, decodes: Callable[[], Sequence[Backend]],
                    pick: Callable[[Sequence[Backend]], Backend]) -> Backend:
        """A decode node for this request, its slot taken (`in_flight`, a lease of the
        request's: given back, the first waiter gets it); raises Overloaded. `decodes` is
        asked again after each wait (health may have changed)."""
        if not self.limit:
            d = pick(_healthy(decodes))
            flight.hold(d, "in_flight")
            return d
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        queued = False
        while True:
            free = self._free(_healthy(decodes))
            if free and (queued or not self.queued):  # nobody ahead of a newcomer
                d = pick(free)
                flight.hold(d, "in_flight", then=self._queue.wake_one)
                return d
            if not queued and self.queued >= self.max_queued:
                self.on_reject("queue_full")
                raise Overloaded(f"overloaded: every decode node has {self.limit} requests "
                                 f"in flight and {self.max_queued} are waiting",
                                 self.queue_timeout_s)
            left = deadline - loop.time()
            if left <= 0:
                self.on_reject("queue_timeout")
                raise Overloaded(f"overloaded: no decode node had a free slot within "
                                 f"{self.queue_timeout_s:g} s", self.queue_timeout_s)
            # A waiter woken earlier whose slot was taken keeps its place at the front.
            await self._queue.wait(left, front=queued)
            queued = True


def _healthy(decodes: Callable[[], Sequence[Backend]]) -> Sequence[Backend]:
    found = decodes()
    if not found:
        raise ProxyError(503, "no decode node is healthy")
    return found
