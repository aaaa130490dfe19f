"""bench/slo.py's goodput arithmetic and bench/goodput.py's summary (no servers)."""

from __future__ import annotations

import pytest

from tests.benchmod import load

slo = load("slo")
goodput = load("goodput")

TIGHT = slo.Slo("tight", ttft_ms=500, gap_ms=100)


def test_a_request_is_good_only_if_it_completed_within_both_limits() -> None:
    assert slo.good(0.4, [0.05, 0.09], "", TIGHT)
    assert not slo.good(0.6, [0.05], "", TIGHT)  # first token late
    assert not slo.good(0.4, [0.05, 0.2, 0.05], "", TIGHT)  # one stall: the worst gap
    assert not slo.good(0.4, [0.05], "timeout", TIGHT)
    assert not slo.good(0.0, [], "", TIGHT)  # a failed request's TTFT reads 0
    assert slo.good(0.4, [], "", TIGHT)  # one token: no gap


def test_attainment_counts_failed_requests_against_the_share() -> None:
    detail = slo.Detail.of({"ttfts": [0.1, 0.1, 0.0, 0.9],
                            "itls": [[0.01], [0.5], [], [0.01]],
                            "errors": ["", "", "reset", ""]})
    assert slo.attainment(detail, TIGHT) == 0.25
    assert slo.attainment(slo.Detail.of({}), TIGHT) == 0.0


def test_goodput_is_the_highest_rate_below_the_first_failure() -> None:
    assert slo.goodput_rate([(0.5, 1.0), (1.0, 0.95), (2.0, 0.5)]) == 1.0
    # a noisy pass above a failure is not capacity
    assert slo.goodput_rate([(2.0, 0.95), (0.5, 1.0), (1.0, 0.8)]) == 0.5
    assert slo.goodput_rate([(0.5, 0.89)]) == 0.0
    assert slo.goodput_rate([(0.5, 0.9), (1.0, 0.9)]) == 1.0


def test_slos_from_an_unloaded_run() -> None:
    base = slo.Detail.of({"ttfts": [0.2, 0.3, 0.4], "itls": [[0.02, 0.02], [0.03], [0.02]],
                          "errors": ["", "", ""]})
    tight, loose = slo.slos_from(base)
    assert (tight.ttft_ms, tight.gap_ms) == pytest.approx((1200, 60))
    assert (loose.ttft_ms, loose.gap_ms) == pytest.approx((2400, 400))
    with pytest.raises(ValueError):
        slo.slos_from(slo.Detail.of({"ttfts": [0.0], "itls": [[]], "errors": ["x"]}))


def test_ratio_and_rates() -> None:
    assert slo.ratio(2.0, 1.0) == "2.00"
    assert slo.ratio(1.0, 0.0) == "inf"
    assert slo.ratio(0.0, 0.0) == "-"
    assert slo.geometric_rates(0.2, 0.8, 3) == [0.2, 0.4, 0.8]
    with pytest.raises(ValueError):
        slo.geometric_rates(1.0, 1.0, 3)


def test_summary_of_a_sweep() -> None:
    def run(ttft: float, gap: float, tput: float) -> dict:
        return {"ttfts": [ttft] * 10, "itls": [[0.02, gap]] * 10, "errors": [""] * 10,
                "request_throughput": tput}

    rates = [0.5, 1.0]
    sweep = goodput.Sweep(goodput.WORKLOADS["long"], 1, rates,
                          cold={"plain": run(0.2, 0.02, 0.4), "auto": run(0.2, 0.02, 0.5)},
                          runs={"plain": {0.5: run(0.2, 0.02, 0.5), 1.0: run(0.2, 1.0, 0.9)},
                                "auto": {0.5: run(0.2, 0.02, 0.5), 1.0: run(0.3, 0.03, 0.95)}},
                          placed={"remote": 3.0})
    sm = goodput.summary(sweep)
    assert sm["slos"]["tight"] == {"ttft_ms": 800.0, "gap_ms": 60.0}
    assert sm["setups"]["plain"]["tight_goodput"] == 0.5
    assert sm["setups"]["auto"]["tight_goodput"] == 1.0
    assert sm["setups"]["auto"]["throughput"] == 0.95
    assert sm["setups"]["auto"]["cold_throughput"] == 0.5
    goodput.print_table(sm)  # renders without servers
