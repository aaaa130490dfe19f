"""Routing policies: which P (and dp rank) and which D serve a request.

- `round_robin`, `least_outstanding`: by turn, by requests in flight;
- `cache_aware` (the default): with the prefix index's lookup (appliance.proxy.prefix), the
  node that has the least to compute for this prompt, against its load. P: the least of its
  queued prefill work plus twice the prompt tokens it would compute (P's time to the first
  token grows with both; what it computes also takes capacity from every later request, so
  a P caching the prompt keeps it until its queue outweighs the work saved). D: among the
  decode nodes whose
  requests in flight are within a band of the least loaded (D's load is its decodes: each
  one it takes slows every step), the one caching most of the prompt; ties go round.
  Without a lookup (index off, a short prompt) it is round robin;
- `cache_aware_sglang`: the SGLang gateway's cache-aware rule, on the same index, the
  baseline bench/xpyd.py compares with: the least loaded when loads are imbalanced (max -
  min > 64 and max > 1.5x min), else the best prefix match if it covers more than 0.3 of
  the prompt, else the node caching least.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from appliance.proxy.nodes.backends import Backend
from appliance.proxy.prefix.cache import Lookup

B = TypeVar("B", bound=Backend)

# cache_aware: D nodes with at most this many more requests in flight than the least loaded
# one (or this share more) may be chosen for their cache.
BAND_ABS = 2
BAND_REL = 0.5
# SGLang's cache-aware defaults (sgl-model-gateway: balance_abs_threshold,
# balance_rel_threshold, cache_threshold).
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
SGLANG_CACHE_THRESHOLD = 0.3


class Policy(Protocol):
    def pick(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B: ...


class RoundRobin:
    """In turn over the nodes in rotation now; a node leaving the rotation shifts the turn."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        b = candidates[self._turn % len(candidates)]
        self._turn += 1
        return b


class LeastOutstanding:
    """Fewest requests in flight; ties go to the node picked least often, so an idle
    cluster is still used in turn."""

    def pick(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        return min(candidates, key=lambda b: (b.in_flight, b.picked))


class _Rotating:
    """Ties go round: the candidates are rotated one further at each pick, and the first
    best of that order wins (a node back in rotation is not flooded, as a lifetime count
    of picks would); without a lookup, plain round robin."""

    def __init__(self) -> None:
        self._turn = 0

    def _rotated(self, candidates: Sequence[B]) -> list[B]:
        k = self._turn % len(candidates)
        self._turn += 1
        return [*candidates[k:], *candidates[:k]]


class CacheAwarePrefill(_Rotating):
    def pick(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        order = self._rotated(candidates)
        if lookup is None:
            return order[0]
        # Its own work counts twice: once in its wait, once in the capacity it takes from
        # the requests behind it (a prefix computed again on another P is work done twice).
        return min(order, key=lambda b: (
            b.prefill_tokens + 2 * (lookup.tokens - lookup.on(b.url)), b.in_flight))


class CacheAwareDecode(_Rotating):
    def pick(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        order = self._rotated(candidates)
        if lookup is None:
            return order[0]
        least = min(b.in_flight for b in order)
        band = least + max(BAND_ABS, BAND_REL * least)
        return min((b for b in order if b.in_flight <= band),
                   key=lambda b: (-lookup.on(b.url), b.in_flight))


class SGLangCacheAware(_Rotating):
    def pick(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        order = self._rotated(candidates)
        if lookup is None:
            return order[0]
        loads = [b.in_flight for b in order]
        if max(loads) - min(loads) > SGLANG_BALANCE_ABS and \
                max(loads) > SGLANG_BALANCE_REL * min(loads):
            return min(order, key=lambda b: b.in_flight)
        best = max(order, key=lambda b: lookup.on(b.url))
        if lookup.on(best.url) > SGLANG_CACHE_THRESHOLD * lookup.tokens:
            return best
        return min(order, key=lambda b: lookup.held.get(b.url, 0))


def make_policy(name: str, role: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "cache_aware":
        return CacheAwarePrefill() if role == "prefill" else CacheAwareDecode()
    if name == "cache_aware_sglang":
        return SGLangCacheAware()
    raise ValueError(f"unknown routing policy {name!r}")


class Router:
    """One policy instance per role, so P's and D's turns do not interfere."""

    def __init__(self, policy: str) -> None:
        self._prefill = make_policy(policy, "prefill")
        self._decode = make_policy(policy, "decode")

    def pick_prefill(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        b = self._prefill.pick(candidates, lookup)
        b.picked += 1
        return b

    def pick_decode(self, candidates: Sequence[B], lookup: Lookup | None = None) -> B:
        b = self._decode.pick(candidates, lookup)
        b.picked += 1
        return b
