"""Pure transfer planning, part one: KV regions from real tensor layouts (docs/protocol.md step 3).

Nothing here touches torch, Mooncake or sockets: inputs are plain ints and tuples, so every rule
is tested on synthetic shapes; part two (block pairing, descriptors) is `descriptors`. A
*region* is one run of equally spaced blocks in memory: block ``i`` of a region lives at
``base_addr + i * block_stride`` and is ``block_bytes`` long. One KV cache tensor yields
one region per combination of its "outer" dimensions (the flash-attention layout
``[2, num_blocks, ...]`` gives a K and a V region per layer, the CPU layout
``[num_blocks, kv_heads, block_size, 2*head_dim]`` one region per layer).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.sidechannel.messages import region_problem


class PlanError(ValueError):
    """A transfer cannot be planned; nothing may be written."""


class LayoutError(PlanError):
    """A KV tensor's shape/strides cannot be described as regions."""


class LayoutMismatchError(PlanError):
    """P's and D's regions do not correspond one to one with equal block sizes."""


class BlockRangeError(PlanError):
    """A block id lies outside its side's cache."""


class BlockCountError(PlanError):
    """D asks for more blocks than P holds for the request."""



@dataclass(frozen=True, slots=True)
class Region:
    """Block ``i`` is ``block_bytes`` long at ``base_addr + i * block_stride``; the region
    belongs to KV-cache group ``group`` (whose block ids address it), and each block is
    ``heads`` KV heads one after another (0: not known to be head-major; see tpplan)."""

    base_addr: int
    block_stride: int
    block_bytes: int
    num_blocks: int
    group: int = 0
    heads: int = 0

    def __post_init__(self) -> None:
        # The rule P applies to a layout D sends (the side channel's): one rule for both.
        if problem := region_problem(self.base_addr, self.block_stride, self.block_bytes,
                                     self.num_blocks, self.group, self.heads):
            raise LayoutError(problem)

    @property
    def contiguous(self) -> bool:
        """Consecutive blocks touch, so a run of them is one memory chunk."""
        return self.block_stride == self.block_bytes or self.num_blocks == 1

    @property
    def span(self) -> tuple[int, int]:
        """(address, length) covering every block of the region."""
        return self.base_addr, (self.num_blocks - 1) * self.block_stride + self.block_bytes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What planning needs from a tensor; ``strides`` are in elements, as torch reports them."""

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    elem_size: int
    # The allocation the tensor is a view of (torch's untyped storage): (address, bytes).
    storage: tuple[int, int] | None = None

    @classmethod
    def from_tensor(cls, tensor: Any) -> TensorInfo:
        """Read a torch tensor (duck-typed, so this module never imports torch)."""
        storage = tensor.untyped_storage()
        return cls(
            int(tensor.data_ptr()),
            tuple(int(n) for n in tensor.shape),
            tuple(int(s) for s in tensor.stride()),
            int(tensor.element_size()),
            (int(storage.data_ptr()), int(storage.nbytes())),
        )

    @property
    def storage_span(self) -> tuple[int, int]:
        """(address, length) of the whole allocation; the tensor's own span if unknown."""
        return self.storage if self.storage is not None else self.span

    @property
    def span(self) -> tuple[int, int]:
        """(address, length) of the bytes the tensor can touch (positive strides)."""
        if any(n == 0 for n in self.shape):
            return self.data_ptr, 0
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.data_ptr, last * self.elem_size + self.elem_size

    def regions(self, num_blocks: int, block_dim: int | None = None,
                group: int = 0) -> list[Region]:
        return regions_from_layout(
            self.data_ptr, self.shape, self.strides, self.elem_size, num_blocks, block_dim, group
        )


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The one dimension whose size is ``num_blocks``; ambiguity is an error, not a guess."""
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise LayoutError(f"no dimension of shape {tuple(shape)} has size num_blocks={num_blocks}")
    if len(candidates) > 1:
        raise LayoutError(
            f"dimensions {candidates} of shape {tuple(shape)} all have size num_blocks="
            f"{num_blocks}: pass block_dim explicitly (see block_dim_by_probe)"
        )
    return candidates[0]


def block_dim_by_probe(shape_for: Callable[[int], Sequence[int]]) -> int:
    """The block dimension of a layout, found by asking it for two different block counts.

    ``shape_for(n)`` gives the KV tensor shape for ``n`` blocks, e.g. ``lambda n: backend.
    get_kv_cache_shape(n, block_size, num_kv_heads, head_size)``: exact, where matching
    sizes against ``num_blocks`` can be ambiguous.
    """
    a, b = tuple(shape_for(7919)), tuple(shape_for(7927))  # primes no other dim will equal
    changed = [d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(changed) != 1:
        raise LayoutError(f"cannot tell the block dimension from shapes {a} and {b}")
    return changed[0]


def regions_from_layout(
    data_ptr: int,
    shape: Sequence[int],
    strides: Sequence[int],
    elem_size: int,
    num_blocks: int,
    block_dim: int | None = None,
    group: int = 0,
) -> list[Region]:
    """Regions of one KV tensor, from its shape and strides (never from an assumed layout).

    Dimensions with a larger stride than the block dimension are *outer*: each combination of
    their indices is a separate region, in logical index order (so P and D pair regions the same
    way even when their physical orders differ). Dimensions with a smaller stride are *inner*:
    the dense ones form one block's chunk, in any physical order (HND or NHD); an inner
    dimension with a gap below it splits the block into one chunk per index (more regions).
    """
    ndim = len(shape)
    if len(strides) != ndim:
        raise LayoutError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in length")
    if elem_size <= 0 or num_blocks <= 0:
        raise LayoutError(f"elem_size and num_blocks must be positive ({elem_size}, {num_blocks})")
    if block_dim is None:
        block_dim = find_block_dim(shape, num_blocks)
    if not -ndim <= block_dim < ndim:
        raise LayoutError(f"block_dim {block_dim} out of range for {ndim} dimensions")
    block_dim %= ndim
    if shape[block_dim] != num_blocks:
        raise LayoutError(f"dimension {block_dim} has size {shape[block_dim]}, not {num_blocks}")
    block_stride = strides[block_dim] * elem_size
    if num_blocks > 1 and block_stride <= 0:
        raise LayoutError(f"block dimension has non-positive stride {strides[block_dim]}")

    outer: list[int] = []
    inner: list[int] = []
    for d, (n, s) in enumerate(zip(shape, strides, strict=True)):
        if d == block_dim or n == 1:  # size-1 dimensions carry arbitrary strides
            continue
        if n <= 0:
            raise LayoutError(f"dimension {d} is empty in shape {tuple(shape)}")
        stride = s * elem_size
        if stride <= 0:
            raise LayoutError(f"dimension {d} has stride {s}: broadcast or reversed views alias")
        # A size-1 block dimension shares its stride with the next outer dimension.
        if stride > block_stride or (stride == block_stride and num_blocks == 1):
            outer.append(d)
        elif stride < block_stride:
            inner.append(d)
        else:
            raise LayoutError(f"dimension {d} has the same stride as the block dimension")

    # The densest inner dimensions form one block's chunk; an inner dimension with a gap
    # below it (e.g. heads in BHLNC, where the other layers sit between) starts separate
    # chunks, so it and every larger inner dimension become outer ones (more regions).
    block_bytes = extent = elem_size
    dense = True
    for d in sorted(inner, key=lambda d: strides[d]):
        stride = strides[d] * elem_size
        if stride < extent:
            raise LayoutError(
                f"inner dimensions of shape {tuple(shape)} strides {tuple(strides)} overlap: "
                f"dimension {d} has stride {strides[d]} within {extent // elem_size} elements"
            )
        dense = dense and stride == block_bytes
        if dense:
            block_bytes *= shape[d]
        else:
            outer.append(d)
        extent += (shape[d] - 1) * stride
    outer.sort()  # logical index order, whatever the physical one
    if num_blocks == 1:
        block_stride = block_bytes  # one block: the stride is never used
    elif block_stride < extent:
        raise LayoutError(f"blocks overlap: stride {block_stride} B < block of {extent} B")

    regions = []
    for index in itertools.product(*(range(shape[d]) for d in outer)):
        offset = sum(i * strides[d] * elem_size for i, d in zip(index, outer, strict=True))
        regions.append(Region(data_ptr + offset, block_stride, block_bytes, num_blocks, group))
    return regions


def registration_spans(items: Iterable[TensorInfo | tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, length) spans to register with Mooncake: one per allocation, each once.

    A TensorInfo counts as its storage, the allocation its view lives in: the views of one
    allocation (every layer of the CPU cache, K and V of one layer) register it once, whole,
    as the reference registers each storage once. Distinct allocations stay distinct even
    where they touch (a caching allocator carves neighbours out of one segment): GPUDirect
    registration may refuse a span that is not one allocation. Spans that overlap (views
    given as bare spans) are merged.
    """
    spans = sorted(
        span
        for span in (item if isinstance(item, tuple) else item.storage_span for item in items)
        if span[1] > 0
    )
    merged: list[list[int]] = []
    for addr, length in spans:
        if merged and addr < merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], addr + length - merged[-1][0])
        else:
            merged.append([addr, length])
    return [(a, n) for a, n in merged]
