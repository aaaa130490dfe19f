"""Regions from the KV views vLLM 0.32 really builds, for every physical layout it can choose.

vLLM's GPU and CPU model runners both make each layer's cache with
`kv_cache_interface.create_kv_cache_views` on one flat buffer; only the layout (chosen from
the attention backends' and the connector's preferences) and kernel block splitting differ.
This runs vLLM's own function for each `KVCacheLayout`, on the CPU, and checks that every
region block the connector would send covers exactly the bytes of that layer's block: the
arithmetic the GPU path depends on, without a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from appliance.connector.planning.descriptors import build_descriptors  # noqa: E402
from appliance.connector.worker import kv_regions  # noqa: E402

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 3, 10, 4, 16, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_views(layout: KVCacheLayout, kernel_block: int | None, padded: int | None = None):
    spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                 dtype=torch.bfloat16, page_size_padded=padded)
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    tensor = kvi.KVCacheTensor(size=size, layers=NAMES, layer_stride=layer_stride,
                               block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    views = kvi.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor,
                                      kernel_block_size=kernel_block)
    return raw, dict(zip(NAMES, views, strict=True))


@pytest.mark.parametrize("kernel_block", [None, 8])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_each_region_block_is_exactly_the_layers_block(layout, kernel_block) -> None:
    try:
        raw, caches = vllm_views(layout, kernel_block)
    except ValueError:
        pytest.skip(f"vLLM refuses kernel blocks of {kernel_block} tokens under {layout.name}")
    regions, _ = kv_regions(caches, BLOCKS)
    assert len(regions) % LAYERS == 0
    per_layer = len(regions) // LAYERS
    base = raw.data_ptr()
    for li, name in enumerate(NAMES):
        grouped = caches[name].unflatten(0, (BLOCKS, -1))  # kernel blocks back to blocks
        for b in (0, 3, BLOCKS - 1):
            raw.zero_()
            grouped[b].view(torch.int8).fill_(1)  # vLLM's idea of layer li's block b
            want = set(torch.nonzero(raw).flatten().tolist())
            got: set[int] = set()
            for r in regions[li * per_layer:(li + 1) * per_layer]:
                start = r.base_addr - base + b * r.block_stride
                got.update(range(start, start + r.block_bytes))
            assert got == want, (layout.name, li, b)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC],
                         ids=lambda layout: layout.name)
def test_padded_pages_send_only_the_page(layout) -> None:
    """Hybrid models pad every page to a common size: blocks stop touching, nothing breaks."""
    page = HEADS * BLOCK * 2 * HEAD * 2
    raw, caches = vllm_views(layout, None, padded=page + 512)
    regions, _ = kv_regions(caches, BLOCKS)
    assert len(regions) == LAYERS and {r.block_bytes for r in regions} == {page}
    assert not any(r.contiguous for r in regions)
    for li, name in enumerate(NAMES):
        raw.zero_()
        caches[name][4].view(torch.int8).fill_(1)
        start = regions[li].base_addr - raw.data_ptr() + 4 * regions[li].block_stride
        assert set(torch.nonzero(raw).flatten().tolist()) == set(range(start, start + page))


def test_the_connectors_layout_coalesces_to_one_descriptor_per_layer() -> None:
    """LBHNC (what `get_required_kvcache_layout` asks for): a run of blocks is one copy."""
    _, p = vllm_views(KVCacheLayout.LBHNC, None)
    _, d = vllm_views(KVCacheLayout.LBHNC, None)
    (p_regions, _), (d_regions, _) = kv_regions(p, BLOCKS), kv_regions(d, BLOCKS)
    assert len(p_regions) == LAYERS
    descs = build_descriptors(p_regions, d_regions, [2, 3, 4, 5], [6, 7, 8, 9])
    assert len(descs) == LAYERS and set(descs.lengths) == {4 * HEADS * BLOCK * 2 * HEAD * 2}


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_head_slices_for_a_different_tp_cover_exactly_those_heads(layout) -> None:
    """P and D of different TP move a slice of each block's heads (tpplan.narrow). Layouts
    with heads outermost in a page (LBHNC, what the connector asks for, and BLHNC) are
    sliceable, and a slice is exactly vLLM's bytes of those heads; the others say so."""
    from appliance.connector.planning.tpplan import Pull, narrow

    raw, caches = vllm_views(layout, None)
    regions, _ = kv_regions(caches, BLOCKS, None, HEADS)
    if layout not in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC):
        assert all(r.heads == 0 for r in regions)
        return
    assert all(r.heads == HEADS for r in regions)
    src, _ = narrow(regions, regions, Pull(0, p_offset=1, d_offset=1, heads=2))
    base = raw.data_ptr()
    for li, name in enumerate(NAMES):
        raw.zero_()
        caches[name][5, 1:3].view(torch.int8).fill_(1)  # heads 1 and 2 of block 5
        r = src[li]
        start = r.base_addr - base + 5 * r.block_stride
        assert set(torch.nonzero(raw).flatten().tolist()) == set(range(start,
                                                                       start + r.block_bytes))
