"""D's KV layout on the side channel (docs/protocol.md step 21): the connector's planning
regions (`plan.Region`) to the wire's compact `RegionMsg`s, and back on P.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from appliance.connector.planning.plan import LayoutError, Region
from appliance.sidechannel.messages import MessageError, RegionMsg


def layout_to_wire(regions: Iterable[Region]) -> list[RegionMsg]:
    return [RegionMsg(r.base_addr, r.block_stride, r.block_bytes, r.num_blocks, r.group,
                      r.heads) for r in regions]


def layout_from_wire(layout: Sequence[RegionMsg]) -> list[Region]:
    """Regions from the wire; impossible geometry (overlapping blocks, empty) is rejected."""
    try:
        return [Region(m.base_addr, m.block_stride, m.block_bytes, m.num_blocks, m.group,
                       m.heads) for m in layout]
    except LayoutError as exc:
        raise MessageError(f"bad layout: {exc}") from None
