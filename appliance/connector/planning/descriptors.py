"""Pure transfer planning, part two: P's blocks paired with D's, descriptors, batches
(docs/protocol.md step 28). Regions come from `plan`; nothing here touches torch, Mooncake
or sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from appliance.connector.planning.plan import (
    BlockCountError,
    BlockRangeError,
    LayoutMismatchError,
    Region,
)

# Mooncake's per-peer TCP lane rejects bigger batches at once and leaves D partly written
# (verified-facts.md), so no batch may exceed this many descriptors.
MAX_BATCH_DESCS = 1024
# Block ids per KV-cache group: vLLM's hybrid allocator gives every group (full attention,
# each sliding-window pattern) its own block table over one shared pool of block ids.
GroupBlocks = Sequence[Sequence[int]]

S = TypeVar("S", bound=Sequence[int])


def pair_blocks(src_ids: S, dst_ids: S) -> tuple[S, S]:
    """Match P's blocks to D's: D with a local prefix hit asks only for P's LAST blocks."""
    if len(dst_ids) > len(src_ids):
        raise BlockCountError(f"D asks for {len(dst_ids)} blocks but P holds {len(src_ids)}")
    skip = len(src_ids) - len(dst_ids)
    return src_ids[skip:], dst_ids  # type: ignore[return-value]


def _ids_array(ids: Sequence[int] | np.ndarray, side: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BlockRangeError(f"{side} block ids must be a flat list of integers")
    return arr.astype(np.int64, copy=False)


def _run_starts(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Indices where a new run begins (both sides must step by exactly one to continue)."""
    if src.size == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    return np.concatenate(([0], np.flatnonzero(breaks) + 1))


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) for each stretch where both sides are consecutive."""
    src, dst = _ids_array(src_ids, "P"), _ids_array(dst_ids, "D")
    if src.size != dst.size:
        raise BlockCountError(f"{src.size} source blocks for {dst.size} destination blocks")
    starts = _run_starts(src, dst)
    counts = np.diff(np.append(starts, src.size))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), counts.tolist(), strict=True))


@dataclass(slots=True)
class Descriptors:
    """Parallel lists for ``batch_transfer_sync_write(session, srcs, dsts, lengths)``."""

    srcs: list[int] = field(default_factory=list)
    dsts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)


def _check_ids(ids: np.ndarray, regions: Sequence[Region], side: str) -> None:
    if ids.size == 0:
        return
    limit = min(r.num_blocks for r in regions)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise BlockRangeError(f"{side} block id {bad} outside its cache of {limit} blocks")


def build_descriptors(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
) -> Descriptors:
    """Descriptors moving blocks ``src_ids`` of P's regions into blocks ``dst_ids`` of D's.

    Protocol step 28: per region pair, runs consecutive on both sides become one descriptor when
    both sides' blocks touch; otherwise one descriptor per block. Every id is checked against its
    side's cache first, so bad metadata raises before anything is written. P's surplus leading
    blocks (D's prefix hit) are skipped, see ``pair_blocks``.
    """
    if len(src_regions) != len(dst_regions):
        raise LayoutMismatchError(f"P has {len(src_regions)} regions, D has {len(dst_regions)}")
    for k, (s, d) in enumerate(zip(src_regions, dst_regions, strict=True)):
        if s.block_bytes != d.block_bytes:
            raise LayoutMismatchError(
                f"region {k}: P blocks are {s.block_bytes} B, D blocks are {d.block_bytes} B"
            )
    src, dst = _ids_array(src_ids, "P"), _ids_array(dst_ids, "D")
    if src_regions:
        _check_ids(src, src_regions, "P")
        _check_ids(dst, dst_regions, "D")
    src, dst = pair_blocks(src, dst)
    if dst.size == 0 or not src_regions:
        return Descriptors()

    starts = _run_starts(src, dst)
    run_len = np.diff(np.append(starts, src.size))
    coalesce = [
        s.contiguous and d.contiguous for s, d in zip(src_regions, dst_regions, strict=True)
    ]
    if all(coalesce) or not any(coalesce):
        # One broadcast over (region, block or run): the common case, and the fast one.
        if all(coalesce):
            src, dst, lens = src[starts], dst[starts], run_len
        else:
            lens = np.ones(src.size, dtype=np.int64)
        srcs = _addresses(src_regions, src)
        dsts = _addresses(dst_regions, dst)
        sizes = _column([r.block_bytes for r in src_regions]) * lens
        return Descriptors(srcs.ravel().tolist(), dsts.ravel().tolist(), sizes.ravel().tolist())
    out = Descriptors()  # mixed layouts: region by region
    for s, d, c in zip(src_regions, dst_regions, coalesce, strict=True):
        part = build_descriptors([s], [d], src, dst) if c else _per_block(s, d, src, dst)
        out.srcs += part.srcs
        out.dsts += part.dsts
        out.lengths += part.lengths
    return out


def build_group_descriptors(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src_groups: GroupBlocks,
    dst_groups: GroupBlocks,
) -> Descriptors:
    """Descriptors for a request of several KV-cache groups: each region moves its own
    group's blocks (P's ``src_groups[g]`` into D's ``dst_groups[g]``, right-aligned as in
    ``pair_blocks``). One group is ``build_descriptors`` itself."""
    if len(src_groups) != len(dst_groups):
        raise LayoutMismatchError(f"P has {len(src_groups)} KV-cache groups, D "
                                  f"{len(dst_groups)}")
    if len(src_regions) != len(dst_regions):
        raise LayoutMismatchError(f"P has {len(src_regions)} regions, D has {len(dst_regions)}")
    groups = sorted({r.group for r in src_regions})
    for k, (s, d) in enumerate(zip(src_regions, dst_regions, strict=True)):
        if s.group != d.group:
            raise LayoutMismatchError(f"region {k}: P's is of group {s.group}, D's {d.group}")
    if groups and groups[-1] >= len(src_groups):
        raise LayoutMismatchError(f"regions of group {groups[-1]} but block ids for "
                                  f"{len(src_groups)} groups")
    if len(src_groups) == 1:
        return build_descriptors(src_regions, dst_regions, src_groups[0], dst_groups[0])
    out = Descriptors()
    for g in groups:
        pick = [k for k, r in enumerate(src_regions) if r.group == g]
        part = build_descriptors([src_regions[k] for k in pick], [dst_regions[k] for k in pick],
                                 src_groups[g], dst_groups[g])
        out.srcs += part.srcs
        out.dsts += part.dsts
        out.lengths += part.lengths
    return out


def _column(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)[:, None]


def _addresses(regions: Sequence[Region], ids: np.ndarray) -> np.ndarray:
    """(regions x ids) matrix of block addresses."""
    bases = _column([r.base_addr for r in regions])
    return bases + _column([r.block_stride for r in regions]) * ids[None, :]


def _per_block(s: Region, d: Region, src: np.ndarray, dst: np.ndarray) -> Descriptors:
    return Descriptors(
        (s.base_addr + src * s.block_stride).tolist(),
        (d.base_addr + dst * d.block_stride).tolist(),
        [s.block_bytes] * src.size,
    )


def split_batches(descs: Descriptors, max_descs: int = MAX_BATCH_DESCS) -> list[Descriptors]:
    """Cut descriptors into batches of at most ``max_descs`` (the per-peer queue limit)."""
    if max_descs < 1:
        raise ValueError(f"max_descs must be at least 1, got {max_descs}")
    return [
        Descriptors(
            descs.srcs[i : i + max_descs],
            descs.dsts[i : i + max_descs],
            descs.lengths[i : i + max_descs],
        )
        for i in range(0, len(descs), max_descs)
    ]
