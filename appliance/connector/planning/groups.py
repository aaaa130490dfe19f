"""KV-cache groups: which models the connector moves, and which blocks of each group.

vLLM's hybrid allocator keeps one KV-cache group per attention pattern (full attention,
each sliding window), every group with its own block table over one shared pool of block
ids; an MLA model is one group of latent caches. A request's KV is then one block list per
group. A sliding-window layer needs only the blocks its window still covers: both sides
keep the last `window_blocks` of the group's list, so P sends (and D asks for) no block the
window has left, and the two lists stay right-aligned as `descriptors.pair_blocks` pairs them.

Pure functions over duck-typed vLLM objects (`kv_cache_config.kv_cache_groups[i]` with
`.kv_cache_spec` and `.layer_names`), so each rule is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's block pool hands out block 0 as the "null block": the placeholder a sliding-window
# table keeps where its window has moved on. It holds nobody's KV, so it is never moved.
NULL_BLOCK = 0

# Spec classes (vLLM's kv_cache_interface) whose KV is plain per-token pages, moved block by
# block. Anything else (Mamba / linear-attention state, chunked local attention, cross- or
# encoder-only attention, sparse caches) is refused at start-up by name.
_FULL = {"FullAttentionSpec", "MLAAttentionSpec"}
_WINDOW = {"SlidingWindowSpec", "SlidingWindowMLASpec"}


class UnsupportedModelError(ValueError):
    """The model's KV cache has a kind of group the connector cannot move."""


@dataclass(frozen=True)
class KVGroup:
    block_size: int  # tokens per block
    window_blocks: int = 0  # blocks a sliding-window layer still needs; 0: full attention

    def needed(self, block_ids: Sequence[int], tokens: int | None = None) -> list[int]:
        """The blocks of a request that must move: all of them (those covering the first
        `tokens`, when given) for full attention, the window's for a sliding window (without
        the null placeholders before it)."""
        ids = list(block_ids)
        if tokens is not None:
            ids = ids[:-(-tokens // self.block_size)]
        if self.window_blocks:
            ids = ids[-self.window_blocks:]
        start = 0
        while start < len(ids) and ids[start] == NULL_BLOCK:
            start += 1
        return ids[start:]


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks covering a window of tokens wherever it starts: one more than it spans, as a
    window rarely begins on a block boundary."""
    return -(-sliding_window // block_size) + 1


def kv_groups(kv_cache_config: Any) -> list[KVGroup]:
    """One KVGroup per KV-cache group, in vLLM's order; raises UnsupportedModelError naming
    the feature when a group cannot be moved."""
    groups = list(kv_cache_config.kv_cache_groups)
    out = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if not getattr(group, "enable_kv_transfer", True):
            raise UnsupportedModelError(
                f"KV-cache group {i} ({kind}) takes no part in KV transfer (a sparse or "
                "host-resident cache); PDConnector moves only attention KV")
        if kind in _FULL:
            out.append(KVGroup(int(spec.block_size)))
        elif kind in _WINDOW:
            if getattr(spec, "extra_retained_tokens", 0):
                raise UnsupportedModelError(
                    f"KV-cache group {i} keeps {spec.extra_retained_tokens} tokens past its "
                    "sliding window (multi-module speculative decoding), which PDConnector "
                    "does not move")
            out.append(KVGroup(int(spec.block_size),
                               window_blocks(int(spec.sliding_window), int(spec.block_size))))
        else:
            raise UnsupportedModelError(
                f"KV-cache group {i} is {kind} ({_FEATURE.get(kind, 'this cache kind')}), "
                "which PDConnector does not move; supported: full attention, MLA, sliding "
                "window")
    return out


_FEATURE = {
    "MambaSpec": "Mamba / linear-attention state",
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "CrossAttentionSpec": "encoder-decoder cross-attention",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "CircularBufferSpec": "a circular-buffer sliding window",
    "RSWASpec": "a retained sliding window",
    # Its sink blocks are the manager's own, not the request's prompt: unverified, refused.
    "SinkFullAttentionSpec": "static attention-sink blocks",
}


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """Layer name -> its KV-cache group."""
    return {name: i for i, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names}


def needed_blocks(groups: Sequence[KVGroup], block_ids: Sequence[Sequence[int]],
                  tokens: int | None = None) -> list[list[int]]:
    """Per group, the blocks that must move (see KVGroup.needed): what P sends and what D
    asks for, by the same rule on both sides."""
    if len(block_ids) != len(groups):
        raise ValueError(f"block ids for {len(block_ids)} KV-cache groups, the model has "
                         f"{len(groups)}")
    return [g.needed(ids, tokens) for g, ids in zip(groups, block_ids, strict=True)]
