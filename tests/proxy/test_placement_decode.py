"""Adaptive disaggregation's decode steps: a step's time grows with the requests in it, so
P alone may start a request later than D would when D holds more of them."""

from __future__ import annotations

import asyncio

import pytest

from appliance.proxy.access import AccessRecord as Record
from appliance.proxy.nodes.backends import Backend
from appliance.proxy.placement import Decision, Placement, decide
from appliance.proxy.placement.costmodel import Linear, Mean
from tests.proxy.conftest import MakeCluster


def test_linear_slope_only_where_the_samples_spread_measured_it() -> None:
    line = Linear()
    assert line.slope() is None
    for _ in range(5):
        line.observe(4, 0.030)
    assert line.slope() is None  # one batch size: the proportional fallback is no slope
    assert line.coefficients() == (0.0, pytest.approx(0.0075))
    for batch in (1, 8, 2, 6):
        line.observe(batch, 0.014 + 0.004 * batch)
    assert line.slope() == pytest.approx(0.004, rel=0.2)


def test_mean_forgets_slowly() -> None:
    mean = Mean()
    assert mean.value is None
    for n in (32, 32, 64):
        mean.observe(n)
    assert 32 < (mean.value or 0) < 48


def _node(steps: dict[int, float]) -> tuple[Placement, Backend, Backend]:
    """P idle; D decodes 7 requests; the prompt's 768-token prefix cached on D only. The
    engines prefill 1,000 tokens a second and decode a request's token in `steps[batch]`."""
    place = Placement("auto", itl_slo_ms=100)
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.01)
    for batch, step in steps.items():
        for _ in range(2):
            place.learned("/v1/completions", 0, None, None, step, batch, 32)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    d.decodes = 7
    place._prompts.extend([128] * 8)  # P's latest prefills were short
    return place, p, d


CPU = {1: 0.018, 4: 0.030, 8: 0.046}  # measured shape: ~4 ms more per request in a step
FLAT = {1: 0.030, 4: 0.030, 8: 0.030}  # a GPU at small batches: the step does not grow


@pytest.mark.parametrize("steps,on_d,where", [
    (CPU, 7, "p_alone"),   # 7 decodes on D against none on P: P computes the prefix too
    (CPU, 1, "local"),     # one more on D saves less than computing the prefix costs
    (FLAT, 7, "local"),    # steps that do not grow: first token only, as before
])
def test_p_alone_starts_later_by_what_decoding_beside_fewer_saves(
        steps: dict[int, float], on_d: int, where: str) -> None:
    place, p, d = _node(steps)
    d.decodes = on_d
    e = place.estimates(896, p, d, 0.0, cached_p=0, cached_d=768, max_out=32)
    assert e.alone_s is not None and e.local_s is not None
    assert e.alone_s + e.p_dup_s > e.local_s + e.d_dup_s  # D would answer first
    # The gain: 2 x 32 tokens x 4 ms x the requests D holds more (0 for a flat line).
    assert e.decode_gain_s == pytest.approx(0.256 * on_d if steps is CPU else 0.0, rel=0.2)
    assert decide("auto", e).where == where


def test_the_expected_output_is_the_limit_or_the_recent_mean_if_less() -> None:
    place, p, d = _node(CPU)
    e = place.estimates(896, p, d, 0.0, cached_p=0, cached_d=768, max_out=4)
    assert e.decode_gain_s == pytest.approx(2 * 4 * 0.004 * 7, rel=0.2)
    e = place.estimates(896, p, d, 0.0, cached_p=0, cached_d=768, max_out=4096)
    assert e.decode_gain_s == pytest.approx(2 * 32 * 0.004 * 7, rel=0.2)  # outputs were 32
    assert decide("auto", e).where == "p_alone"


def test_the_access_line_and_status_show_the_decode_gain() -> None:
    place, p, d = _node(CPU)
    e = place.estimates(896, p, d, 0.0, cached_p=0, cached_d=768, max_out=32)
    rec = Record("/v1/completions", "r1", 0.0)
    rec.placed = Decision("p_alone", "balance", 896, 0, 768, e)
    assert " decode_gain_ms=" in rec._weighed()
    step = place.describe()["decode_step"]
    assert step["samples"] == 6 and 3.0 < step["per_1k_tokens_ms"] / 1000 < 5.0


async def test_the_proxy_times_each_stream_against_the_requests_its_node_held(
        make_cluster: MakeCluster) -> None:
    """Streams of 8 tokens, one and three at a time on D: each one's time per token, and
    the requests D held meanwhile, go to the placement's step line."""
    c = await make_cluster(split="never")
    c.decode[0].chunks, c.decode[0].chunk_delay = 8, 0.01

    async def stream() -> None:
        async with c.http.post(f"{c.url}/v1/completions", json={
                "model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}) as r:
            assert r.status == 200
            await r.read()

    await stream()
    await asyncio.gather(stream(), stream(), stream())
    split = (await c.status())["split"]
    assert split["decode_step"]["samples"] == 4
