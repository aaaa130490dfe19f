"""Pure planning: regions from shapes and strides, block pairing, runs, descriptors, batches."""

from __future__ import annotations

import ctypes
import random

import pytest

from appliance.connector.planning import descriptors, plan
from appliance.connector.planning.descriptors import (
    Descriptors,
    block_runs,
    build_descriptors,
    pair_blocks,
    split_batches,
)
from appliance.connector.planning.plan import (
    BlockCountError,
    BlockRangeError,
    LayoutError,
    LayoutMismatchError,
    PlanError,
    Region,
    TensorInfo,
    regions_from_layout,
    registration_spans,
)

MiB = 1 << 20


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


# --- regions_from_layout on synthetic shapes ------------------------------------------------


def test_cpu_layout_is_one_region_per_layer() -> None:
    # [num_blocks, kv_heads, block_size, 2*head_dim], bf16 (facts file)
    shape = (100, 8, 16, 256)
    regions = regions_from_layout(4096, shape, contiguous_strides(shape), 2, 100)
    assert regions == [Region(4096, 8 * 16 * 256 * 2, 8 * 16 * 256 * 2, 100)]
    assert regions[0].contiguous


@pytest.mark.parametrize("shape", [(100, 1, 16, 576), (100, 16, 576)],
                         ids=["cpu-mla", "gpu-mla"])
def test_mla_latent_cache_is_one_region_per_layer(shape) -> None:
    # MLA: one latent (kv_lora_rank 512 + rope 64) per token, no K/V split, no heads:
    # vLLM's CPU MLA cache is [num_blocks, 1, block_size, 576], the GPU ones drop the 1.
    regions = regions_from_layout(8192, shape, contiguous_strides(shape), 2, 100)
    assert regions == [Region(8192, 16 * 576 * 2, 16 * 576 * 2, 100)]


def test_flash_layout_is_two_regions_per_layer() -> None:
    # [2, num_blocks, block_size, kv_heads, head_dim]: K and V are separate regions
    shape = (2, 100, 16, 8, 128)
    chunk = 16 * 8 * 128 * 2
    regions = regions_from_layout(1 << 20, shape, contiguous_strides(shape), 2, 100)
    assert regions == [
        Region(1 << 20, chunk, chunk, 100),
        Region((1 << 20) + 100 * chunk, chunk, chunk, 100),
    ]


def test_flashinfer_layout_is_one_region_per_layer() -> None:
    shape = (100, 2, 16, 8, 128)
    regions = regions_from_layout(0, shape, contiguous_strides(shape), 2, 100)
    assert regions == [Region(0, 2 * 16 * 8 * 128 * 2, 2 * 16 * 8 * 128 * 2, 100)]


def test_permuted_inner_dims_are_one_dense_chunk() -> None:
    # logical NHD [2, nb, block, heads, dim] stored HND: physical [2, nb, heads, block, dim]
    nb, bs, h, d = 50, 16, 8, 128
    phys = contiguous_strides((2, nb, h, bs, d))
    strides = (phys[0], phys[1], phys[3], phys[2], phys[4])
    regions = regions_from_layout(0, (2, nb, bs, h, d), strides, 2, nb)
    chunk = bs * h * d * 2
    assert regions == [Region(0, chunk, chunk, nb), Region(nb * chunk, chunk, chunk, nb)]


def test_block_major_storage_of_a_kv_first_view_is_one_region() -> None:
    # logical [2, nb, ...] over physical [nb, 2, ...]: K/V is inner, whole block one chunk
    nb, bs, h, d = 10, 16, 2, 32
    phys = contiguous_strides((nb, 2, bs, h, d))
    strides = (phys[1], phys[0], phys[2], phys[3], phys[4])
    regions = regions_from_layout(0, (2, nb, bs, h, d), strides, 2, nb)
    assert regions == [Region(0, 2 * bs * h * d * 2, 2 * bs * h * d * 2, nb)]


def test_interleaved_layers_give_strided_regions() -> None:
    # one buffer [nb, layers, heads, bs, 2*dim]; layer l is buf[:, l]: blocks do not touch
    nb, layers, h, bs, w = 20, 3, 2, 16, 64
    full = contiguous_strides((nb, layers, h, bs, w))
    chunk = h * bs * w * 2
    for layer in range(layers):
        r = regions_from_layout(layer * chunk, (nb, h, bs, w), (full[0],) + full[2:], 2, nb)
        assert r == [Region(layer * chunk, layers * chunk, chunk, nb)]
        assert not r[0].contiguous


def test_single_block_cache() -> None:
    cpu = regions_from_layout(64, (1, 4, 16, 64), contiguous_strides((1, 4, 16, 64)), 2, 1)
    assert cpu == [Region(64, 4 * 16 * 64 * 2, 4 * 16 * 64 * 2, 1)]
    shape = (2, 1, 16, 4, 32)
    flash = regions_from_layout(0, shape, contiguous_strides(shape), 2, 1)
    chunk = 16 * 4 * 32 * 2
    assert flash == [Region(0, chunk, chunk, 1), Region(chunk, chunk, chunk, 1)]


def test_explicit_block_dim_resolves_ambiguity() -> None:
    shape = (2, 2, 16, 4, 32)  # num_blocks == 2 == K/V dim
    with pytest.raises(LayoutError, match="pass block_dim"):
        regions_from_layout(0, shape, contiguous_strides(shape), 2, 2)
    regions = regions_from_layout(0, shape, contiguous_strides(shape), 2, 2, block_dim=1)
    assert len(regions) == 2 and regions[1].base_addr == 2 * regions[0].block_stride
    assert regions_from_layout(0, shape, contiguous_strides(shape), 2, 2, block_dim=-4) == regions


@pytest.mark.parametrize(
    ("shape", "strides", "num_blocks", "block_dim", "match"),
    [
        ((10, 4, 16), (64, 16, 1), 7, None, "no dimension"),
        ((10, 4, 16), (64, 16), 10, None, "differ in length"),
        ((10, 4, 16), (64, 16, 1), 10, 3, "out of range"),
        ((10, 4, 16), (64, 16, 1), 10, 1, "has size 4"),
        ((10, 4, 16), (64, 8, 1), 10, None, "overlap"),  # rows overlapping each other
        ((10, 4, 16), (32, 16, 1), 10, None, "overlap"),  # block stride below block size
        ((10, 4, 16), (64, 0, 1), 10, None, "alias"),  # broadcast view
        ((10, 4, 16), (0, 16, 1), 10, None, "non-positive"),
        ((10, 4, 16), (64, 64, 1), 10, None, "same stride"),
    ],
)
def test_impossible_layouts_are_rejected(shape, strides, num_blocks, block_dim, match) -> None:
    with pytest.raises(LayoutError, match=match):
        regions_from_layout(0, shape, strides, 2, num_blocks, block_dim)


def test_gaps_inside_a_block_split_it_into_chunks() -> None:
    """Padded rows, or heads with other layers' heads between them (vLLM's BHLNC): one
    region per row/head, each block of it one dense chunk."""
    regions = regions_from_layout(0, (10, 4, 16), (128, 32, 1), 2, 10)  # rows padded to 32
    assert [(r.base_addr, r.block_stride, r.block_bytes) for r in regions] == [
        (i * 64, 256, 32) for i in range(4)
    ]
    nb, h, n, c, layers = 10, 4, 16, 64, 3  # BHLNC: physical [B, H, L, N, C], layer 1's view
    strides = (h * layers * n * c, layers * n * c, c, 1)
    regions = regions_from_layout(1 * n * c * 2, (nb, h, n, c), strides, 2, nb)
    assert len(regions) == h and not any(r.contiguous for r in regions)
    assert [r.base_addr for r in regions] == [(1 * n * c + i * layers * n * c) * 2
                                               for i in range(h)]
    assert {r.block_bytes for r in regions} == {n * c * 2}


def test_region_rejects_impossible_geometry() -> None:
    with pytest.raises(LayoutError):
        Region(0, 10, 20, 5)
    with pytest.raises(LayoutError):
        Region(-1, 10, 10, 5)
    with pytest.raises(LayoutError):
        Region(0, 10, 0, 5)
    with pytest.raises(LayoutError):
        Region((1 << 63) - 10, 10, 10, 5)
    assert Region(0, 1, 20, 1).span == (0, 20)  # one block: stride irrelevant


# --- cross-check against real torch tensors -------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _region_block(region: Region, block: int) -> bytes:
    return ctypes.string_at(region.base_addr + block * region.block_stride, region.block_bytes)


@pytest.mark.parametrize("layout", ["cpu", "flash", "flashinfer", "hnd", "interleaved", "mla"])
def test_addresses_hit_exactly_the_indexed_block(torch, layout: str) -> None:
    nb, h, bs, d, layers = 12, 2, 4, 8, 3
    g = torch.Generator().manual_seed(1)
    if layout == "cpu":  # all layers views into one buffer, as vLLM's CPU backend does
        buf = torch.empty(layers * nb * h * bs * 2 * d, dtype=torch.bfloat16)
        tensors = [t.view(nb, h, bs, 2 * d) for t in buf.chunk(layers)]
        kv_slices = [lambda t, b: t[b]]
    elif layout == "flash":
        tensors = [torch.empty(2, nb, bs, h, d, dtype=torch.bfloat16) for _ in range(layers)]
        kv_slices = [lambda t, b: t[0, b], lambda t, b: t[1, b]]
    elif layout == "flashinfer":
        tensors = [torch.empty(nb, 2, bs, h, d, dtype=torch.bfloat16) for _ in range(layers)]
        kv_slices = [lambda t, b: t[b]]
    elif layout == "hnd":  # logical NHD, physical HND
        tensors = [
            torch.empty(2, nb, h, bs, d, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
            for _ in range(layers)
        ]
        kv_slices = [lambda t, b: t[0, b], lambda t, b: t[1, b]]
    elif layout == "mla":  # vLLM's CPU MLA: [num_blocks, 1, block_size, latent], one buffer
        latent = 576
        buf = torch.empty(layers * nb * bs * latent, dtype=torch.bfloat16)
        tensors = [t.view(nb, 1, bs, latent) for t in buf.chunk(layers)]
        kv_slices = [lambda t, b: t[b]]
    else:
        buf = torch.empty(nb, layers, h, bs, 2 * d, dtype=torch.bfloat16)
        tensors = [buf[:, i] for i in range(layers)]
        kv_slices = [lambda t, b: t[b]]
    block_dim = 0 if layout in ("cpu", "flashinfer", "interleaved", "mla") else 1
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g))
        regions = TensorInfo.from_tensor(t).regions(nb, block_dim)
        assert len(regions) == len(kv_slices)
        for region, kv_slice in zip(regions, kv_slices, strict=True):
            for b in (0, 5, nb - 1):
                block = kv_slice(t, b)
                if layout == "hnd":  # memory holds the block in physical (HND) order
                    block = block.transpose(0, 1)
                expected = block.contiguous().view(torch.uint8).numpy().tobytes()
                assert _region_block(region, b) == expected


def test_memmove_through_descriptors_equals_tensor_indexing(torch) -> None:
    """Writing through computed addresses moves exactly the indexed blocks, nothing else."""
    nb_p, nb_d, h, bs, d, layers = 40, 64, 2, 16, 16, 4
    g = torch.Generator().manual_seed(7)
    p_buf = torch.randint(0, 256, (layers * nb_p * h * bs * 4 * d,), dtype=torch.uint8, generator=g)
    d_buf = torch.randint(0, 256, (layers * nb_d * h * bs * 4 * d,), dtype=torch.uint8, generator=g)
    p_layers = [t.view(torch.bfloat16).view(nb_p, h, bs, 2 * d) for t in p_buf.chunk(layers)]
    d_layers = [t.view(torch.bfloat16).view(nb_d, h, bs, 2 * d) for t in d_buf.chunk(layers)]
    p_regions = [r for t in p_layers for r in TensorInfo.from_tensor(t).regions(nb_p)]
    d_regions = [r for t in d_layers for r in TensorInfo.from_tensor(t).regions(nb_d)]
    src = [3, 4, 5, 9, 10, 20, 30, 31, 32, 33]
    dst = [60, 61, 62, 0, 1, 7, 40, 41, 50, 51]
    expected = [t.clone() for t in d_layers]
    for e, p in zip(expected, p_layers, strict=True):
        e[dst] = p[src]
    descs = build_descriptors(p_regions, d_regions, src, dst)
    assert len(descs) == layers * 5  # runs: 3..5, 9..10, 20, 30..31, 32..33 pair as 5 runs
    for s, t, n in zip(descs.srcs, descs.dsts, descs.lengths, strict=True):
        ctypes.memmove(t, s, n)
    for got, want in zip(d_layers, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_registration_spans_of_views_into_one_buffer(torch) -> None:
    buf = torch.empty(6 * 10 * 64, dtype=torch.bfloat16)
    layers = [t.view(10, 2, 32) for t in buf.chunk(6)]
    spans = registration_spans(TensorInfo.from_tensor(t) for t in layers)
    assert spans == [(buf.data_ptr(), buf.numel() * 2)]
    inter = torch.empty(10, 6, 64, dtype=torch.bfloat16)
    strided = [inter[:, i] for i in range(6)]
    assert registration_spans(TensorInfo.from_tensor(t) for t in strided) == [
        (inter.data_ptr(), inter.numel() * 2)
    ]
    # A view of part of a buffer registers the whole buffer, once.
    assert registration_spans([TensorInfo.from_tensor(buf[64:128])] * 2) == spans


def test_registration_spans_one_per_allocation(torch) -> None:
    """Each allocation once, whole; two allocations never merged into one span."""
    k, v = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(4, 8, dtype=torch.bfloat16)
    infos = [TensorInfo.from_tensor(t) for t in (k[1:], k[:2], v)]
    assert registration_spans(infos) == sorted(
        [(k.data_ptr(), 64), (v.data_ptr(), 64)])


def test_registration_spans_keep_touching_allocations_apart() -> None:
    """Two allocations carved side by side out of one segment (as a caching allocator
    does), each holding two layers' views: two spans, not one crossing both."""
    a, b = (0x10000, 0x4000), (0x14000, 0x4000)
    views = [TensorInfo(base + off, (4, 256), (256, 1), 2, storage)
             for storage in (a, b) for base in (storage[0],) for off in (0, 0x2000)]
    assert registration_spans(views) == [a, b]
    # Without storages known, the views' own spans: those that overlap merge, touching
    # ones stay apart.
    bare = [TensorInfo(v.data_ptr, v.shape, v.strides, v.elem_size) for v in views]
    assert registration_spans(bare) == [(0x10000, 0x800), (0x12000, 0x800),
                                        (0x14000, 0x800), (0x16000, 0x800)]


# --- registration_spans on synthetic spans ----------------------------------------------------


def test_registration_spans_merge_overlapping_only() -> None:
    spans = [(100, 50), (0, 10), (10, 10), (120, 100), (300, 1), (100, 50), (500, 0)]
    assert registration_spans(spans) == [(0, 10), (10, 10), (100, 120), (300, 1)]
    assert registration_spans([]) == []
    assert registration_spans([(0, 100), (10, 5)]) == [(0, 100)]  # contained


# --- pairing and runs --------------------------------------------------------------------------


def test_pair_blocks_takes_p_last_blocks_on_d_prefix_hit() -> None:
    assert pair_blocks([1, 2, 3, 4], [7, 8]) == ([3, 4], [7, 8])
    assert pair_blocks([1, 2], [7, 8]) == ([1, 2], [7, 8])
    assert pair_blocks([1, 2], []) == ([], [])
    with pytest.raises(BlockCountError):
        pair_blocks([1], [7, 8])
    assert issubclass(BlockCountError, PlanError)


def test_block_runs() -> None:
    assert block_runs([], []) == []
    assert block_runs([5], [9]) == [(5, 9, 1)]
    assert block_runs(range(17, 80), range(512, 575)) == [(17, 512, 63)]
    # a run breaks when either side jumps, even if the other continues
    assert block_runs([1, 2, 3, 7, 8, 9], [4, 5, 9, 10, 11, 12]) == [
        (1, 4, 2),
        (3, 9, 1),
        (7, 10, 3),
    ]
    assert block_runs([3, 2, 1], [1, 2, 3]) == [(3, 1, 1), (2, 2, 1), (1, 3, 1)]
    with pytest.raises(BlockCountError):
        block_runs([1, 2], [1])


# --- descriptors -----------------------------------------------------------------------------


def seeds_regions(base: int, num_blocks: int, layers: int = 36) -> list[Region]:
    """Qwen3-8B per layer in the CPU layout: 8 KV heads x 128 x 16 tokens x K,V x bf16."""
    chunk = 2 * 16 * 8 * 128 * 2  # 64 KiB per layer per block (docs/protocol.md step 3)
    per_layer = chunk * num_blocks
    return [Region(base + i * per_layer, chunk, chunk, num_blocks) for i in range(layers)]


def test_seeds_example_is_one_descriptor_per_region() -> None:
    p = seeds_regions(1 << 30, 100)
    d = seeds_regions(1 << 40, 1000)
    descs = build_descriptors(p, d, range(17, 80), range(512, 575))
    assert len(descs) == 36
    assert descs.total_bytes == 63 * 36 * 64 * 1024 == int(141.75 * MiB)
    assert descs.srcs[0] == (1 << 30) + 17 * 65536 and descs.dsts[0] == (1 << 40) + 512 * 65536
    assert descs.lengths == [63 * 65536] * 36
    assert descs.srcs[35] == (1 << 30) + 35 * 100 * 65536 + 17 * 65536


def test_flash_layout_seeds_example_is_two_descriptors_per_layer() -> None:
    chunk = 16 * 8 * 128 * 2
    p = [Region((1 << 30) + k * 100 * chunk, chunk, chunk, 100) for k in range(72)]
    d = [Region((1 << 40) + k * 1000 * chunk, chunk, chunk, 1000) for k in range(72)]
    descs = build_descriptors(p, d, range(17, 80), range(512, 575))
    assert len(descs) == 72 and descs.total_bytes == int(141.75 * MiB)


def test_non_contiguous_blocks_and_prefix_hit() -> None:
    p = [Region(0, 100, 100, 50), Region(10_000, 100, 100, 50)]
    d = [Region(1 << 20, 100, 100, 20), Region(2 << 20, 100, 100, 20)]
    descs = build_descriptors(p, d, [0, 1, 2, 3, 9, 4], [5, 6, 10, 11, 12])
    # pairs (1,5) (2,6) (3,10) (9,11) (4,12): runs (1,5,2) (3,10,1) (9,11,1) (4,12,1)
    assert descs.srcs == [100, 300, 900, 400, 10_100, 10_300, 10_900, 10_400]
    assert descs.dsts[:4] == [(1 << 20) + 500, (1 << 20) + 1000, (1 << 20) + 1100, (1 << 20) + 1200]
    assert descs.lengths == [200, 100, 100, 100] * 2


def test_strided_regions_get_one_descriptor_per_block() -> None:
    p = [Region(0, 300, 100, 10)]  # interleaved layers: blocks do not touch
    d = [Region(5000, 100, 100, 10)]
    descs = build_descriptors(p, d, [1, 2, 3], [4, 5, 6])
    assert descs == Descriptors([300, 600, 900], [5400, 5500, 5600], [100, 100, 100])
    assert build_descriptors(d, p, [4, 5], [1, 2]) == Descriptors(
        [5400, 5500], [300, 600], [100, 100]
    )


def test_single_block_transfer() -> None:
    descs = build_descriptors([Region(0, 10, 10, 1)], [Region(1000, 10, 10, 5)], [0], [4])
    assert descs == Descriptors([0], [1040], [10])


def test_empty_transfers() -> None:
    r = [Region(0, 10, 10, 5)]
    assert len(build_descriptors(r, r, [], [])) == 0
    assert len(build_descriptors(r, r, [1, 2], [])) == 0
    assert len(build_descriptors([], [], [1, 2], [1, 2])) == 0


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 5], [1, 2], "P block id 5"),
        ([0, 1], [1, 20], "D block id 20"),
        ([-1, 1], [1, 2], "P block id -1"),
        ([0, 1], [-3, 2], "D block id -3"),
    ],
)
def test_out_of_range_ids_raise_before_any_descriptor(src, dst, match) -> None:
    p = [Region(0, 10, 10, 5)] * 2
    d = [Region(1000, 10, 10, 20), Region(5000, 10, 10, 20)]
    with pytest.raises(BlockRangeError, match=match):
        build_descriptors(p, d, src, dst)


def test_range_is_checked_against_the_smallest_region() -> None:
    d = [Region(1000, 10, 10, 20), Region(5000, 10, 10, 8)]
    with pytest.raises(BlockRangeError, match="8 blocks"):
        build_descriptors([Region(0, 10, 10, 20)] * 2, d, [0], [9])


def test_bad_id_types_are_rejected() -> None:
    r = [Region(0, 10, 10, 5)]
    with pytest.raises(BlockRangeError):
        build_descriptors(r, r, [0.5], [1])
    with pytest.raises(BlockRangeError):
        build_descriptors(r, r, [[1]], [[1]])


def test_mismatched_regions_raise() -> None:
    with pytest.raises(LayoutMismatchError, match="2 regions"):
        build_descriptors([Region(0, 10, 10, 5)] * 2, [Region(0, 10, 10, 5)], [0], [0])
    with pytest.raises(LayoutMismatchError, match="region 1"):
        build_descriptors(
            [Region(0, 10, 10, 5)] * 2, [Region(0, 10, 10, 5), Region(100, 20, 20, 5)], [0], [0]
        )
    with pytest.raises(BlockCountError):
        build_descriptors([Region(0, 10, 10, 5)], [Region(0, 10, 10, 5)], [0], [0, 1])


def test_many_blocks_many_layers_match_a_naive_plan() -> None:
    rng = random.Random(3)
    p = [Region((1 << 32) + i * 4_000_000, 640, 640, 6000) for i in range(24)]
    d = [Region((1 << 36) + i * 3_000_000, 640 * 3, 640, 4000) for i in range(24)]
    src = rng.sample(range(6000), 3000)
    src[100:200] = range(5000, 5100)
    dst = rng.sample(range(4000), 2500)
    descs = build_descriptors(p, d, src, dst)
    naive = [
        (pr.base_addr + s * pr.block_stride, dr.base_addr + t * dr.block_stride, pr.block_bytes)
        for pr, dr in zip(p, d, strict=True)
        for s, t in zip(src[-2500:], dst, strict=True)
    ]
    assert list(zip(descs.srcs, descs.dsts, descs.lengths, strict=True)) == naive


# --- batches -----------------------------------------------------------------------------------


def _descs(n: int) -> Descriptors:
    return Descriptors(list(range(n)), list(range(100, 100 + n)), [1] * n)


@pytest.mark.parametrize(
    ("n", "limit", "sizes"),
    [
        (0, 1024, []),
        (1, 1024, [1]),
        (1024, 1024, [1024]),
        (1025, 1024, [1024, 1]),
        (2048, 1024, [1024, 1024]),
        (5, 2, [2, 2, 1]),
        (3, 1, [1, 1, 1]),
    ],
)
def test_split_batches(n: int, limit: int, sizes: list[int]) -> None:
    descs = _descs(n)
    batches = split_batches(descs, limit)
    assert [len(b) for b in batches] == sizes
    assert [x for b in batches for x in b.srcs] == descs.srcs
    assert [x for b in batches for x in b.dsts] == descs.dsts
    assert sum(b.total_bytes for b in batches) == descs.total_bytes


def test_split_batches_default_and_bad_limit() -> None:
    assert [len(b) for b in split_batches(_descs(3000))] == [1024, 1024, 952]
    assert descriptors.MAX_BATCH_DESCS == 1024
    with pytest.raises(ValueError):
        split_batches(_descs(3), 0)


def test_block_dim_by_probe() -> None:
    assert plan.block_dim_by_probe(lambda n: (2, n, 16, 8, 128)) == 1
    assert plan.block_dim_by_probe(lambda n: (n, 8, 16, 256)) == 0
    with pytest.raises(LayoutError):
        plan.block_dim_by_probe(lambda n: (2, 16))
    with pytest.raises(LayoutError):
        plan.block_dim_by_probe(lambda n: (n, n))
