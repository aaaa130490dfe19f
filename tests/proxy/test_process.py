"""The proxy's process after start-up: what start-up built is frozen out of the collector's
way, and young collections come less often (appliance.proxy.__main__)."""

from __future__ import annotations

import gc

from appliance.proxy.__main__ import GC_YOUNG, _settle_heap


async def test_the_heap_is_settled_after_start_up() -> None:
    before = gc.get_threshold()
    built = [{"start-up": i} for i in range(100)]  # alive as long as the process
    try:
        await _settle_heap(None)  # type: ignore[arg-type]
        assert gc.get_freeze_count() >= len(built)
        assert gc.get_threshold() == (GC_YOUNG, *before[1:])
        assert GC_YOUNG > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
