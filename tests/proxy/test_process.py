"""The proxy's process after start-up: what start-up built is frozen out of the collector's
way, young collections come less often, and the C heap is trimmed while it runs
(appliance.proxy.heap)."""

from __future__ import annotations

import asyncio
import gc

from aiohttp import web

from appliance.proxy import heap


async def test_the_heap_is_settled_after_start_up() -> None:
    before = gc.get_threshold()
    built = [{"start-up": i} for i in range(100)]  # alive as long as the process
    try:
        await heap.settled(None)  # type: ignore[arg-type]
        assert gc.get_freeze_count() >= len(built)
        assert gc.get_threshold() == (heap.GC_YOUNG, *before[1:])
        assert heap.GC_YOUNG > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_glibc_trim_is_found_and_runs() -> None:
    trim = heap.malloc_trim()
    assert trim is not None  # glibc here (and in the images); musl would give None
    assert trim(0) in (0, 1)  # 1: memory was given back


async def test_the_heap_is_trimmed_each_interval_until_the_app_stops() -> None:
    calls: list[int] = []
    app = web.Application()
    app.cleanup_ctx.append(heap.trimmed(lambda pad: calls.append(pad) or 0, interval_s=0.01))
    runner = web.AppRunner(app)
    await runner.setup()  # runs the context's start
    try:
        for _ in range(200):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        assert calls[:3] == [0, 0, 0]
    finally:
        await runner.cleanup()
    stopped = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == stopped  # no trim after the app stopped
