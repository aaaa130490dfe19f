"""Callers waiting their turn for something freed one at a time (a pooled connection, a
decode node's slot): first come, first served, each woken once."""

from __future__ import annotations

import asyncio
from collections import deque


class WaitQueue:
    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    async def wait(self, timeout: float, front: bool = False) -> bool:
        """Until woken (True) or `timeout` passes (False); `front`: ahead of the others (a
        caller woken before whose turn was taken)."""
        fut = asyncio.get_running_loop().create_future()
        (self._waiters.appendleft if front else self._waiters.append)(fut)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if not fut.done():
                fut.cancel()
            while self._waiters and self._waiters[0].done():
                self._waiters.popleft()

    def wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
