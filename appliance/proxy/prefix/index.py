"""What each engine holds in its prefix cache, as its own KV events say (pure: no sockets).

One `Source` per engine event stream (a node's URL and data-parallel rank). A stored
block's hash is checked against the one this proxy computes from its token ids
(appliance.proxy.prefix.hashing); an engine whose hashes differ (another hash algorithm or
seed) is marked unusable and predicts nothing, rather than predicting wrong. A source whose
stream has a gap that replay could not fill, or whose engine restarted, is dropped: the
decision then falls back to load alone for that node until new events arrive.

Besides what the events say, the blocks of prompts placed on a node to compute and not yet
done are `expected` there: the engine caches a prompt's blocks as it schedules them, so a
second request with the same prefix that comes before the first one's events finds them
(a burst on a shared system prompt). Without this the index calls that second prompt cold
everywhere and sends it anywhere, to compute the prefix once more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.proxy.prefix import hashing
from appliance.proxy.prefix.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

log = logging.getLogger("appliance.proxy.prefix")

# Offload tiers publish their own media; only the engine's KV memory serves a prefill.
_MEDIA = (None, "GPU")

SeqStep = Literal["next", "old", "gap", "restart"]


def seq_step(last: int, seq: int) -> SeqStep:
    """How a batch's sequence number follows the last one applied (-1: none yet)."""
    if seq == last + 1:
        return "next"
    if seq > last + 1:
        return "gap"
    if seq == 0 and last > 0:
        return "restart"  # a new publisher counts from 0
    return "old"  # already applied (replay overlapping the live stream)


@dataclass
class Source:
    node: str
    rank: int
    blocks: set[int] = field(default_factory=set)
    # Full hashes of the blocks whose chain this proxy verified: a child is checked with them.
    full: dict[int, bytes] = field(default_factory=dict)
    block_size: int | None = None
    seq: int = -1
    batches: int = 0
    verified: int = 0
    mismatched: int = 0
    drops: int = 0
    usable: bool = True

    def clear(self) -> None:
        self.blocks.clear()
        self.full.clear()


class PrefixIndex:
    def __init__(self, seed: str = hashing.DEFAULT_SEED) -> None:
        self.seed = seed
        self._sources: dict[tuple[str, int], Source] = {}
        # Per node, the blocks of prompts it computes now: how many such prompts hold each.
        self._expected: dict[str, dict[int, int]] = {}

    def source(self, node: str, rank: int) -> Source:
        key = (node, rank)
        if key not in self._sources:
            self._sources[key] = Source(node, rank)
        return self._sources[key]

    def apply(self, src: Source, seq: int, events: Iterable[Event]) -> None:
        src.seq = seq
        src.batches += 1
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(src, ev)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in _MEDIA and not ev.group_idx:
                    for h in ev.block_hashes:
                        x = _ext(h)
                        src.blocks.discard(x)
                        src.full.pop(x, None)
            elif isinstance(ev, AllBlocksCleared):
                src.clear()

    def _stored(self, src: Source, ev: BlockStored) -> None:
        if ev.medium not in _MEDIA or ev.group_idx:
            return
        src.block_size = ev.block_size
        parent = None if ev.parent_block_hash is None else _ext(ev.parent_block_hash)
        # The parent's full hash, when known; None with a parent: the chain is unverifiable.
        full = None if parent is None else src.full.get(parent)
        known = parent is None or full is not None
        bs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            x = _ext(h)
            src.blocks.add(x)
            extra = ev.extra_keys[i] if ev.extra_keys and i < len(ev.extra_keys) else None
            chunk = ev.token_ids[i * bs:(i + 1) * bs]
            if not known or extra is not None or len(chunk) != bs:
                known = False
                continue
            mine = hashing.block_hash(full, chunk, self.seed)
            if hashing.external(mine) == x:
                src.full[x] = full = mine
                src.verified += 1
            else:
                known = False
                src.mismatched += 1
                if src.usable:
                    src.usable = False
                    log.warning("prefix index: %s rank %d stores blocks whose hashes differ "
                                "from this proxy's (is the engine's --prefix-caching-hash-algo "
                                "sha256_cbor, and its PYTHONHASHSEED the proxy's seed?); its "
                                "cache is not predicted", src.node, src.rank)

    def drop(self, node: str, why: str, rank: int | None = None) -> None:
        """Forget what a node's engine (one rank, or all) holds: it restarted, left, or its
        stream lost events that replay could not bring back."""
        for (url, r), src in self._sources.items():
            if url == node and (rank is None or r == rank):
                if src.blocks:
                    log.info("prefix index: dropped %s rank %d (%d blocks): %s", url, r,
                             len(src.blocks), why)
                src.clear()
                src.seq = -1
                src.drops += 1

    def remove(self, node: str) -> None:
        for key in [k for k in self._sources if k[0] == node]:
            del self._sources[key]
        self._expected.pop(node, None)

    def expect(self, node: str, hashes: Sequence[int]) -> None:
        """A prompt with these full blocks is being computed on `node` (until `unexpect`)."""
        held = self._expected.setdefault(node, {})
        for h in hashes:
            held[h] = held.get(h, 0) + 1

    def unexpect(self, node: str, hashes: Sequence[int]) -> None:
        """That prompt is done (or failed): its blocks are in the events, or not at all."""
        held = self._expected.get(node)
        if held is None:
            return
        for h in hashes:
            n = held.get(h, 0) - 1
            if n > 0:
                held[h] = n
            else:
                held.pop(h, None)
        if not held:
            del self._expected[node]

    def block_size(self, nodes: Iterable[str]) -> int | None:
        wanted = set(nodes)
        for (url, _), src in self._sources.items():
            if url in wanted and src.block_size:
                return src.block_size
        return None

    def cached_blocks(self, node: str, hashes: Sequence[int], expected: bool = False) -> int:
        """Leading blocks of a prompt (its external hashes) that the node holds: the best
        of its ranks (which rank serves the request is the engine's choice). `expected`:
        count the blocks of prompts it computes now too."""
        return self.cached_and_expected(node, hashes)[1 if expected else 0]

    def cached_and_expected(self, node: str, hashes: Sequence[int]) -> tuple[int, int]:
        """(cached_blocks(node, hashes), the same with expected=True), in one pass."""
        soon = self._expected.get(node, {})
        best_stored = best = 0
        for (url, _), src in self._sources.items():
            if url != node or not src.usable:
                continue
            stored = n = 0
            for h in hashes:
                if h in src.blocks:
                    n += 1
                    stored += stored == n - 1  # still the leading run of stored blocks
                elif h in soon:
                    n += 1
                else:
                    break
            best_stored, best = max(best_stored, stored), max(best, n)
        return best_stored, best

    def blocks_held(self, node: str) -> int:
        return sum(len(s.blocks) for (url, _), s in self._sources.items()
                   if url == node and s.usable)

    def has_blocks(self) -> bool:
        return any(src.blocks for src in self._sources.values() if src.usable)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (url, rank), s in sorted(self._sources.items()):
            out.setdefault(url, {})[str(rank)] = {
                "blocks": len(s.blocks), "block_size": s.block_size, "seq": s.seq,
                "batches": s.batches, "verified": s.verified, "mismatched": s.mismatched,
                "drops": s.drops, "usable": s.usable,
                "expected_blocks": len(self._expected.get(url, ()))}
        return out


def _ext(h: int | bytes) -> int:
    return h if isinstance(h, int) else hashing.external(h)
