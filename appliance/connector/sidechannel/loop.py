"""A background asyncio loop for a worker's side channel (docs/protocol.md steps 1, 5).

vLLM calls the connector from its worker thread once per step; everything that waits
(ZMQ, bootstrap HTTP, deadlines) runs on this loop instead, and blocking batch writes run
on a thread pool so a slow transfer never stalls the forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("vllm.appliance.connector")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(_log_exception)
        self.loop.run_forever()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop soon; returns at once (for calls from vLLM's thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def call_wait(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Run fn(*args) on the loop after everything called before it, and wait for it."""
        async def call() -> T:
            return fn(*args)

        return self.run(call(), timeout)

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop after `delay` seconds; returns at once."""
        self.loop.call_soon_threadsafe(self.loop.call_later, delay, fn, *args)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_cancel_all(), timeout)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


def _log_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    log.error("side-channel loop: %s", context.get("message"), exc_info=exc)
