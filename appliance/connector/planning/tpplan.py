"""Heterogeneous TP: which prefill ranks hold a decode rank's KV heads, and the slice of each
block that moves between them. Pure functions over plain ints and `plan.Region`s.

Each TP rank holds `total / tp` of the model's KV heads, or, when there are more ranks than
heads, one head replicated on `tp / total` ranks (vLLM's rule). A decode rank pulls its heads
from every prefill rank that holds some of them (P TP=2 -> D TP=1: from both; P TP=1 -> D
TP=2: both decode ranks from the one prefill rank, each its half). MLA's latent has no heads:
every rank holds all of it, and a decode rank pulls whole blocks from one prefill rank.
Equal TP is rank r to rank r, whole blocks: the fast path, no slicing at all.

A head slice of a block is one chunk only when the block is head-major (vLLM's HND pages,
which the connector asks for with the LBHNC layout): `Region.heads` says how many heads
a region's block holds in that order (0: not head-major, so it cannot be sliced).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from appliance.connector.planning.plan import LayoutMismatchError, PlanError, Region

WHOLE = -1  # Pull.heads for "the whole block": equal TP, or MLA's replicated latent


@dataclass(frozen=True)
class Pull:
    """D's rank pulls `heads` heads from P's rank `p_rank`: P's block from head `p_offset`
    into D's block from head `d_offset` (WHOLE: the whole block into the whole block)."""

    p_rank: int
    p_offset: int = 0
    d_offset: int = 0
    heads: int = WHOLE


def rank_heads(rank: int, tp: int, total: int) -> range:
    """Global KV head indices TP rank `rank` of `tp` holds."""
    if not 0 <= rank < tp:
        raise PlanError(f"tp rank {rank} outside tp size {tp}")
    if total <= 0:
        raise PlanError(f"{total} KV heads")
    if tp <= total:
        if total % tp:
            raise PlanError(f"{total} KV heads do not split over tp {tp}")
        per = total // tp
        return range(rank * per, (rank + 1) * per)
    if tp % total:
        raise PlanError(f"tp {tp} is not a multiple of the {total} KV heads it replicates")
    first = rank * total // tp
    return range(first, first + 1)


def pulls_for(d_rank: int, d_tp: int, p_tp: int, total_heads: int | None) -> list[Pull]:
    """What decode rank `d_rank` pulls, from which prefill ranks (`total_heads` 0: MLA;
    None: unknown, so only equal TP can pair)."""
    if not 0 <= d_rank < d_tp or p_tp < 1:
        raise PlanError(f"decode tp rank {d_rank} of {d_tp}, prefill tp {p_tp}")
    if d_tp == p_tp:
        return [Pull(d_rank)]
    if total_heads is None:
        raise PlanError(f"decode tp {d_rank}/{d_tp} cannot pair with prefill tp size {p_tp}: "
                        "the model's KV heads are unknown")
    if total_heads == 0:  # one latent, on every rank
        return [Pull(d_rank % p_tp)]
    want = rank_heads(d_rank, d_tp, total_heads)
    pulls: list[Pull] = []
    covered = want.start
    for p in range(p_tp):
        have = rank_heads(p, p_tp, total_heads)
        lo, hi = max(covered, have.start), min(want.stop, have.stop)
        if lo < hi:  # a head replicated on several prefill ranks comes from the first
            pulls.append(Pull(p, lo - have.start, lo - want.start, hi - lo))
            covered = hi
    if covered != want.stop:
        raise PlanError(f"no prefill rank holds heads {covered}..{want.stop - 1}")
    return pulls


def pull_served_by(p_rank: int, p_tp: int, d_rank: int, d_tp: int,
                   total_heads: int | None) -> Pull | None:
    """The part of decode rank `d_rank`'s pull that prefill rank `p_rank` serves, or None
    when that decode rank pulls nothing from it."""
    for pull in pulls_for(d_rank, d_tp, p_tp, total_heads):
        if pull.p_rank == p_rank:
            return pull
    return None


def pullers_of(p_rank: int, p_tp: int, d_tp: int, total_heads: int | None) -> list[int]:
    """Decode ranks that pull from prefill rank `p_rank`: it frees a prompt's blocks only
    once each of them has been served."""
    return [r for r in range(d_tp) if pull_served_by(p_rank, p_tp, r, d_tp, total_heads)]


def unpulled_ranks(p_tp: int, d_tp: int, total_heads: int | None) -> list[int]:
    """Prefill ranks no decode rank pulls from (P's TP larger than D's: MLA's latent comes
    from one rank per decode rank, a replicated head from the first rank holding it). They
    computed the prompt too and hold its blocks until told nobody will ask."""
    pulled = {p.p_rank for r in range(d_tp) for p in pulls_for(r, d_tp, p_tp, total_heads)}
    return [p for p in range(p_tp) if p not in pulled]


def narrow(src: list[Region], dst: list[Region], pull: Pull) -> tuple[list[Region],
                                                                      list[Region]]:
    """P's and D's regions cut down to the heads `pull` moves: each block's slice starts
    `offset * head_bytes` in and is `heads * head_bytes` long; strides are unchanged."""
    if pull.heads == WHOLE:
        return src, dst
    if len(src) != len(dst):
        raise LayoutMismatchError(f"P has {len(src)} regions, D has {len(dst)}")
    out_src, out_dst = [], []
    for k, (s, d) in enumerate(zip(src, dst, strict=True)):
        if s.heads <= 0 or d.heads <= 0:
            raise LayoutMismatchError(
                f"region {k} is not head-major on both sides (heads {s.heads}, {d.heads}): "
                "a different TP on P and D needs vLLM's HND pages (the LBHNC layout)")
        if s.block_bytes % s.heads or d.block_bytes % d.heads:
            raise LayoutMismatchError(f"region {k}: blocks do not divide into their heads")
        head = s.block_bytes // s.heads
        if d.block_bytes // d.heads != head:
            raise LayoutMismatchError(f"region {k}: a head is {head} B on P, "
                                      f"{d.block_bytes // d.heads} B on D")
        if pull.p_offset + pull.heads > s.heads or pull.d_offset + pull.heads > d.heads:
            raise LayoutMismatchError(f"region {k}: heads {pull} beyond P's {s.heads} or "
                                      f"D's {d.heads}")
        out_src.append(replace(s, base_addr=s.base_addr + pull.p_offset * head,
                               block_bytes=pull.heads * head, heads=pull.heads))
        out_dst.append(replace(d, base_addr=d.base_addr + pull.d_offset * head,
                               block_bytes=pull.heads * head, heads=pull.heads))
    return out_src, out_dst


@dataclass(frozen=True)
class Leg:
    """One decode rank's share of a transfer: what a prefill worker writes for it."""

    d_rank: int  # the decode TP rank that asked
    pullers: int  # decode ranks that pull from this worker (1 unless D's TP is larger)
    src: list[Region]  # P's regions, narrowed to the heads this rank gets
    dst: list[Region]  # D's, likewise


def leg_for(p_rank: int, p_tp: int, d_rank: int, d_tp: int, total_heads: int | None,
            src: list[Region], dst: list[Region]) -> Leg:
    """What prefill rank `p_rank` writes for decode rank `d_rank`: its share of that rank's
    heads (all of them at equal TP) as regions narrowed on both sides; raises PlanError
    (the request is refused, nothing written) when the two cannot pair."""
    pull = pull_served_by(p_rank, p_tp, d_rank, d_tp, total_heads)
    if pull is None:
        raise PlanError(f"decode tp {d_rank}/{d_tp} pulls nothing from prefill tp "
                        f"{p_rank}/{p_tp}")
    if len(dst) != len(src):
        raise LayoutMismatchError(f"KV layouts differ: decode has {len(dst)} regions, "
                                  f"prefill {len(src)}")
    src_n, dst_n = narrow(src, dst, pull)
    if [(r.block_bytes, r.group) for r in src_n] != [(r.block_bytes, r.group) for r in dst_n]:
        raise LayoutMismatchError(f"KV layouts differ: decode has {len(dst)} regions, prefill "
                                  f"{len(src)}, or their block sizes or KV-cache groups differ")
    return Leg(d_rank, len(pullers_of(p_rank, p_tp, d_tp, total_heads)), src_n, dst_n)


def head_major(shape: tuple[int, ...], strides: tuple[int, ...], elem_size: int,
               block_dim: int | None, kv_heads: int, block_bytes: int) -> int:
    """`kv_heads` when a region's `block_bytes` are that many heads one after another
    (some dimension of `kv_heads` entries, other than the block's, strides exactly one
    head), else 0."""
    if kv_heads == 1:
        return 1
    for d, (n, s) in enumerate(zip(shape, strides, strict=True)):
        if d != block_dim and n == kv_heads and s * elem_size * kv_heads == block_bytes:
            return kv_heads
    return 0
