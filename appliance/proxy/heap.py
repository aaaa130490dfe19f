"""The proxy process's heap: settled once after start-up, and the C heap's free pages given
back to the system while it runs.

Python objects do not grow with the proxy's age (tracemalloc over a soak of the local node:
flat), yet its RSS crept up by 4-6% in 8-15 minutes of mixed load: pages that glibc's
malloc keeps after they are freed (native buffers outside Python's heap, spread over the
C heap, where free() gives nothing back unless the heap's top is free).
`malloc_trim(0)` every TRIM_INTERVAL_S returns them: over the same soak, RSS after each
trim stayed within 1% from the first minute to the fifth, at about 0.2 ms a call (3.6 ms
the first time). A host whose C library has no malloc_trim (musl) skips it.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

log = logging.getLogger("appliance.proxy")

# Allocations of container objects between young-generation collections (Python's default:
# 700, every few requests: each makes hundreds, aiohttp's among them). Measured under
# bench/proxy_overhead.py's load at concurrency 64: collections took 7% of the proxy's CPU
# as it was, 5% with start-up frozen, 3% with this too (each young one about 1 ms; 20,000
# saved no more and paused for 3.5 ms).
GC_YOUNG = 5_000
# Seconds between trims: RSS is a gauge SREs alert on; a minute's creep is a few hundred KiB.
TRIM_INTERVAL_S = 30.0


async def settled(_app: web.Application) -> None:
    """An on_startup hook, after the proxy's own start (modules, settings, the tokenizer:
    alive as long as the process): freeze what start-up built, so that no collection walks
    it again, and collect young objects less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


async def trim_every(interval_s: float, trim: Callable[[int], int]) -> None:
    """Until cancelled: the C heap's free pages back to the system, each interval."""
    while True:
        await asyncio.sleep(interval_s)
        trim(0)


def trimmed(trim: Callable[[int], int] | None = None, interval_s: float = TRIM_INTERVAL_S
            ) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context: the heap trimmed from the app's start until it stops. `trim`:
    glibc's by default."""
    async def context(_app: web.Application) -> AsyncIterator[None]:
        fn = trim if trim is not None else malloc_trim()
        if fn is None:
            log.debug("no malloc_trim in this C library: the heap is not trimmed")
            yield
            return
        task = asyncio.create_task(trim_every(interval_s, fn), name="proxy-heap-trim")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return context
