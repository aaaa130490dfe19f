"""A node out of rotation on purpose hands its long answers over instead of cutting them.

A drained node (`POST /admin/drain`, `pdctl drain`) or one leaving (a terminating pod) gets
nothing new and finishes what it has. What it still holds `drain_handover_s` later (or the
drain's own `handover_after_s`) is failed here as a node found down: each answer goes on from
another engine after the tokens the client has (appliance.proxy.exchange.migration, within
`migration_limit`), so the node can stop without cutting a stream, and its operator need not
wait for the longest answer. An answer that cannot go on (migration's limits) ends with an
error, as it would when the node stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from appliance.proxy.nodes.backends import Backend, Backends
from appliance.proxy.nodes.background import Background

log = logging.getLogger("appliance.proxy.handover")
TICK_S = 0.5


def due(out_since: float, now: float, after_s: float) -> bool:
    """Whether a node out of rotation since `out_since` hands over now (0: never)."""
    return after_s > 0 and now - out_since >= after_s


class Handover(Background):
    task_name = "proxy-drain-handover"

    def __init__(self, backends: Backends, after_s: float,
                 fail_node: Callable[[str, str], int]) -> None:
        self.backends = backends
        self.after_s = after_s  # the setting; a drain may name its own
        self._fail_node = fail_node
        self._since: dict[str, float] = {}  # url -> when it left rotation on purpose
        self._after: dict[str, float] = {}  # a drain's own handover_after_s
        self._done: set[str] = set()
        Background.__init__(self)

    def drained(self, url: str, after_s: float | None) -> None:
        """A drain that names its own wait (None: the setting's)."""
        if after_s is None:
            self._after.pop(url, None)
        else:
            self._after[url] = after_s

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        out = {b.url: b for b in self.backends.all() if b.draining or b.leaving}
        for url in list(self._since):
            if url not in out:  # back in rotation (undrained, or named again)
                del self._since[url]
                self._done.discard(url)
                self._after.pop(url, None)
        for url, b in out.items():
            since = self._since.setdefault(url, now)
            after = self._after.get(url, self.after_s)
            if url in self._done or not b.in_flight or not due(since, now, after):
                continue
            self._done.add(url)
            self._hand_over(b, after)

    def _hand_over(self, b: Backend, after: float) -> None:
        why = (f"{b.role} node {b.url} was drained {after:g} s ago and still answering: "
               "handed over")
        moved = self._fail_node(b.url, why)
        log.warning("%s %s out of rotation for %g s with %d requests in flight: %d calls "
                    "handed over to other engines", b.role, b.url, after, b.in_flight, moved)
