"""KV digests: D checks that its blocks hold what P read before a step uses them.

A digest is the sum, modulo 2^64, of mix(word, address) over the 8-byte words written, each
at its address in D's memory. A sum over words at their destination addresses does not
depend on how the bytes were cut into descriptors, legs or prefill ranks: each P worker sums
the slices it wrote for a request (its source bytes, D's addresses), D sums its whole
destination blocks once, and the two agree when every byte landed where it belongs. Not a
MAC (the side channel's CURVE key says who P is): it catches bytes that are not what P
read, a write that landed in part, in the wrong blocks, or not at all.

The arithmetic is written twice, in numpy for KV in CPU memory and in torch for KV in GPU
memory (a reduction on the device, no copy to the host); tests hold the two equal.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.connector.planning.descriptors import GroupBlocks, pair_blocks
from appliance.connector.planning.plan import Region
from appliance.connector.settings import VerifyKv

SAMPLE_ONE_IN = 16  # `sample`: one pull in this many is checked
_MASK = (1 << 64) - 1
_K0 = 0x9E3779B97F4A7C15  # odd constants of splitmix64: addresses and words spread over
_K1 = 0xBF58476D1CE4E5B9  # all 64 bits before the sum
_WORDS_AT_ONCE = 1 << 15  # words per numpy pass: 256 KiB temporaries, in the L2 cache


@dataclass(frozen=True)
class Slice:
    """Blocks `ids` of `region` in this process, each summed at the address of the block
    in D's memory it was written to (`dst`, block `dst_ids`)."""

    region: Region
    ids: Sequence[int]
    dst: Region
    dst_ids: Sequence[int]

    @property
    def aligned(self) -> bool:
        """Whole words on both sides (always, for KV of 2-byte or 4-byte elements)."""
        r, d = self.region, self.dst
        return all(v % 8 == 0 for v in (r.base_addr, r.block_stride, r.block_bytes,
                                         d.base_addr, d.block_stride))

    def seeds(self) -> np.ndarray:
        """Each block's address in D's memory."""
        ids = np.asarray(self.dst_ids, dtype=np.uint64)
        return ids * np.uint64(self.dst.block_stride) + np.uint64(self.dst.base_addr)


def sent_slices(src: Sequence[Region], dst: Sequence[Region], src_groups: GroupBlocks,
                dst_groups: GroupBlocks) -> list[Slice]:
    """What a P worker wrote for one leg: its regions (narrowed to the leg's heads) paired
    with D's, per KV-cache group, P's surplus leading blocks skipped as the write skipped
    them (`descriptors.pair_blocks`)."""
    out = []
    for s, d in zip(src, dst, strict=True):
        ids, dst_ids = pair_blocks(list(src_groups[s.group]), list(dst_groups[d.group]))
        if dst_ids:
            out.append(Slice(s, ids, d, dst_ids))
    return out


def received_slices(regions: Sequence[Region], groups: GroupBlocks) -> list[Slice]:
    """What D received for a request: its whole blocks, at their own addresses."""
    return [Slice(r, list(groups[r.group]), r, list(groups[r.group]))
            for r in regions if r.group < len(groups) and groups[r.group]]


# --- numpy (KV in CPU memory) --------------------------------------------------------------

def _mix_sum_np(words: np.ndarray, seeds: np.ndarray, scratch: np.ndarray) -> int:
    """Σ mix(word, address) over rows of words; row i starts at address seeds[i]. Works in
    `scratch` (two rows' worth of words or more): no allocation per call."""
    rows, k = words.shape
    x = scratch[:rows * k].reshape(rows, k)
    t = scratch[rows * k:2 * rows * k].reshape(rows, k)
    np.add(words, (seeds * np.uint64(_K0))[:, None], out=x)
    x += _offsets(k)[None, :]
    x *= np.uint64(_K1)
    np.right_shift(x, np.uint64(31), out=t)
    x ^= t
    return int(x.sum(dtype=np.uint64))


_OFFSETS: dict[int, np.ndarray] = {}


def _offsets(k: int) -> np.ndarray:
    """Each word's address within its row, times K0 (a row's address times K0 is added)."""
    got = _OFFSETS.get(k)
    if got is None:
        got = _OFFSETS[k] = np.arange(k, dtype=np.uint64) * np.uint64((8 * _K0) & _MASK)
    return got


def _region_words_np(region: Region) -> np.ndarray:
    """The region as (blocks x words), a view of process memory (nothing copied)."""
    span = (region.num_blocks - 1) * region.block_stride + region.block_bytes
    flat = np.frombuffer((ctypes.c_char * span).from_address(region.base_addr), dtype="<u8")
    return np.lib.stride_tricks.as_strided(
        flat, shape=(region.num_blocks, region.block_bytes // 8),
        strides=(region.block_stride, 8), writeable=False)


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) index ranges of `ids` over which the ids rise by one."""
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    edges = [0, *breaks.tolist(), int(ids.size)]
    return list(zip(edges[:-1], edges[1:], strict=False))


def digest_cpu(slices: Sequence[Slice]) -> int | None:
    """The digest of these slices of CPU memory; None when one is not whole words. Runs of
    consecutive blocks are read in place, a few hundred KiB at a time (the temporaries stay
    in cache)."""
    if not all(s.aligned for s in slices):
        return None
    total = 0
    scratch = np.empty(2 * _WORDS_AT_ONCE, dtype=np.uint64)
    for s in slices:
        view, seeds, ids = _region_words_np(s.region), s.seeds(), np.asarray(s.ids)
        k = view.shape[1]
        if 2 * k > scratch.size:
            scratch = np.empty(2 * k, dtype=np.uint64)
        step = max(1, scratch.size // (2 * k))
        for lo, hi in _runs(ids):
            first = int(ids[lo])
            for i in range(lo, hi, step):
                j = min(hi, i + step)
                total += _mix_sum_np(view[first + i - lo:first + j - lo], seeds[i:j], scratch)
    return total & _MASK


# --- torch (KV in GPU memory, summed where it lies) ----------------------------------------

def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class _DeviceMemory:
    """Device memory at an address, as torch.as_tensor reads it (CUDA array interface)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes // 8,), "typestr": "<i8",
                                         "data": (addr, False), "version": 3}


def device_words(device: Any) -> Callable[[int, int], Any]:
    """(address, bytes) -> int64 tensor over that memory of `device`, nothing copied."""
    import torch

    return lambda addr, nbytes: torch.as_tensor(_DeviceMemory(addr, nbytes), device=device)


def digest_torch(slices: Sequence[Slice], words_at: Callable[[int, int], Any]) -> int | None:
    """The digest of these slices of memory `words_at` reads as int64 tensors; equal to
    `digest_cpu` on the same bytes (int64 arithmetic wraps as uint64's does)."""
    import torch

    if not all(s.aligned for s in slices):
        return None
    total = 0
    for s in slices:
        r = s.region
        span = (r.num_blocks - 1) * r.block_stride + r.block_bytes
        flat = words_at(r.base_addr, span)
        k = r.block_bytes // 8
        rows = torch.as_strided(flat, (r.num_blocks, k), (r.block_stride // 8, 1))
        ids = torch.as_tensor(np.asarray(s.ids, dtype=np.int64), device=flat.device)
        seeds = torch.as_tensor(s.seeds().view(np.int64), device=flat.device)
        offsets = torch.arange(k, dtype=torch.int64, device=flat.device) * _signed(
            (8 * _K0) & _MASK)
        x = rows.index_select(0, ids) + (seeds * _signed(_K0)).unsqueeze(1)
        x += offsets.unsqueeze(0)
        x *= _signed(_K1)
        x ^= (x >> 31) & ((1 << 33) - 1)  # a logical shift of the same bits
        total += int(x.sum().item())
    return total & _MASK


def digester_for(device: Any) -> Callable[[Sequence[Slice]], int | None]:
    """The digest function for KV on `device` (a torch device; None or CPU: numpy)."""
    if getattr(device, "type", "cpu") != "cuda":
        return digest_cpu
    words_at = device_words(device)
    return lambda slices: digest_torch(slices, words_at)


def chosen(policy: VerifyKv, rng: random.Random | None = None) -> bool:
    """Whether a pull is checked under `policy`."""
    if policy == "all":
        return True
    if policy == "sample":
        return (rng or random).randrange(SAMPLE_ONE_IN) == 0
    return False


def combine(digests: Sequence[int]) -> int:
    """The digest of several P workers' writes into one request's blocks."""
    return sum(digests) & _MASK
