"""Goodput arithmetic for bench/goodput.py (pure functions, no servers).

A request is good when it completed, its first token came within the TTFT SLO, and its
worst gap between two streamed tokens stayed within the gap SLO: the stall a streaming user
sees (a mean TPOT hides one long prefill among fifty quick steps). A setup's goodput is the
highest swept arrival rate at which at least `ATTAINMENT` of the requests were good, every
lower swept rate passing too (a noisy pass above a failure is not capacity).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

ATTAINMENT = 0.9  # DistServe's: the share of requests that must meet the SLO


@dataclass(frozen=True)
class Slo:
    name: str
    ttft_ms: float
    gap_ms: float


@dataclass(frozen=True)
class Detail:
    """One run's requests, as `vllm bench serve --save-detailed` writes them (seconds)."""
    ttfts: Sequence[float]
    itls: Sequence[Sequence[float]]
    errors: Sequence[str]

    @classmethod
    def of(cls, result: dict) -> Detail:
        n = len(result.get("ttfts") or [])
        return cls(result.get("ttfts") or [], result.get("itls") or [[]] * n,
                   [e or "" for e in (result.get("errors") or [""] * n)])


def good(ttft_s: float, itls_s: Sequence[float], error: str, slo: Slo) -> bool:
    if error or not ttft_s or ttft_s <= 0:
        return False
    worst = max(itls_s, default=0.0)
    return ttft_s * 1000 <= slo.ttft_ms and worst * 1000 <= slo.gap_ms


def attainment(detail: Detail, slo: Slo) -> float:
    """The share of the run's requests that met `slo` (0 for an empty run)."""
    n = len(detail.ttfts)
    if not n:
        return 0.0
    return sum(good(t, g, e, slo)
               for t, g, e in zip(detail.ttfts, detail.itls, detail.errors, strict=True)) / n


def goodput_rate(points: Sequence[tuple[float, float]], need: float = ATTAINMENT) -> float:
    """The highest rate of (rate, attainment) points, taken in rising rate, below which no
    point failed `need`; 0 when the lowest failed."""
    best = 0.0
    for rate, share in sorted(points):
        if share < need:
            break
        best = rate
    return best


def worst_gaps_ms(detail: Detail) -> list[float]:
    return [max(g, default=0.0) * 1000 for g, e in zip(detail.itls, detail.errors, strict=True)
            if not e]


def slos_from(baseline: Detail, tight_gap_x: float = 3.0, loose_gap_x: float = 20.0,
              ttft_x: float = 4.0) -> tuple[Slo, Slo]:
    """A tight and a loose SLO from an unloaded run (the plain server at the lowest rate):
    TTFT within `ttft_x` of its median; the worst gap within `tight_gap_x` of its median
    step (a prefill among the decodes breaks it) or `loose_gap_x` (only a pile-up does)."""
    ttfts = [t * 1000 for t, e in zip(baseline.ttfts, baseline.errors, strict=True)
             if not e and t > 0]
    steps = [x * 1000 for g, e in zip(baseline.itls, baseline.errors, strict=True) if not e
             for x in g]
    if not ttfts or not steps:
        raise ValueError("the baseline run has no completed request with streamed tokens")
    ttft, step = statistics.median(ttfts), statistics.median(steps)
    return (Slo("tight", ttft_x * ttft, tight_gap_x * step),
            Slo("loose", 2 * ttft_x * ttft, loose_gap_x * step))


def ratio(a: float, b: float) -> str:
    """a / b for a table: "inf" where only `a` met the SLO at all, "-" where neither did."""
    if b > 0:
        return f"{a / b:.2f}"
    return "inf" if a > 0 else "-"


def geometric_rates(low: float, high: float, points: int) -> list[float]:
    """`points` arrival rates from `low` to `high`, evenly spaced in log."""
    if points < 2 or low <= 0 or high <= low:
        raise ValueError("need at least 2 points and 0 < low < high")
    step = math.log(high / low) / (points - 1)
    return [round(low * math.exp(step * i), 3) for i in range(points)]
