"""Adaptive disaggregation against a fake clock: what `auto` measured must not hold it
where the node no longer is. A whole local or P-alone answer's prefill stops counting as
queued once it is predicted done (not when the answer ends), and one outlier handoff does
not switch `remote` off for good."""

from __future__ import annotations

import pytest

from appliance.proxy.nodes.backends import Backend
from appliance.proxy.placement import Placement
from appliance.proxy.placement.costmodel import Linear


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _trained(split: str, clock: Clock) -> tuple[Placement, Backend, Backend]:
    """Prefills take 1 ms a token; a handoff of 100 tokens 10 ms."""
    place = Placement(split, itl_slo_ms=None, clock=clock)  # type: ignore[arg-type]
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.01)
    return place, Backend("prefill", "http://p"), Backend("decode", "http://d")


@pytest.mark.parametrize("stream", [False, True])
def test_a_whole_answers_prefill_leaves_the_queue_when_predicted_done(stream: bool) -> None:
    """A non-stream local answer's first byte is its last: its prefill (2 s predicted) must
    not keep counting on D for the minute its decode takes. A stream's first token closes
    its ticket, so it has no predicted end."""
    clock = Clock()
    place, p, d = _trained("never", clock)
    body = {"prompt": list(range(2000)), "stream": stream}
    _, first, _ = place.choose(body, "/v1/completions", p, d)
    assert d.prefill_tokens == 2000
    assert first.due == (None if stream else pytest.approx(clock.now + 2.0))
    clock.now += 60.0  # still decoding
    _, second, _ = place.choose({"prompt": list(range(10))}, "/v1/completions", p, d)
    if stream:  # open until its first token is seen
        assert first.open and d.prefill_tokens == 2010 and place._waited(d, clock.now) == 60.0
    else:
        assert not first.open and d.prefill_tokens == 10 and second.ahead == 0
        assert place._waited(d, clock.now) == 0.0


def test_a_p_alone_whole_answer_has_a_predicted_end_too() -> None:
    clock = Clock()
    place, p, d = _trained("auto", clock)
    # Nothing cached, P idle, D decoding: P alone when its prefills are short.
    place.learned("/v1/completions", 0, None, None, 0.03, 4, 16)
    place._prompts.extend([64] * 8)
    d.decodes = 4
    decision, ticket, _ = place.choose({"prompt": list(range(64))}, "/v1/completions", p, d)
    assert decision.where == "p_alone"
    assert ticket.backend is p and ticket.due == pytest.approx(clock.now + 0.064)
    clock.now += 1.0
    place.choose({"prompt": list(range(8))}, "/v1/completions", p, d)
    assert not ticket.open and place._waited(p, clock.now) == 0.0


def test_one_outlier_handoff_moves_the_line_little() -> None:
    """Twenty handoffs of 10 ms, then one of 12 s (a saturated D, a recompute): the line
    counts it as four times itself, not as 12 s."""
    line = Linear(half_life_s=30.0, clip=4.0)
    for _ in range(20):
        line.observe(100, 0.01, now=0.0)
    line.observe(100, 12.0, now=0.0)
    assert line.predict(100) == pytest.approx(0.01, rel=0.5)


def test_a_handoff_that_turned_remote_off_is_forgotten_with_time() -> None:
    """The first handoff timed is an outlier: remote looks 12 s slower, so `auto` keeps
    requests local and no remote stream times the handoff again. With time the line is
    forgotten, remote is tried, and what it measures then decides."""
    clock = Clock()
    place, p, d = _trained("auto", clock)
    place.handoff = Linear(half_life_s=place.handoff.half_life_s, clip=place.handoff.clip)
    place.handoff.observe(100, 12.0, now=clock.now)
    d.prefill_tokens = 500  # D is a little busier than P: remote would be sooner
    body = {"prompt": list(range(100))}
    decision, ticket, _ = place.choose(body, "/v1/completions", p, d)
    assert decision.where == "local"  # remote looks 12 s slower
    ticket.close(clock.now, learn=False)
    clock.now += 90.0  # three half-lives without a remote sample
    decision, ticket, _ = place.choose(body, "/v1/completions", p, d)
    assert decision.where == "remote" and place.handoff.samples == 0
    ticket.close(clock.now, learn=False)
    place.learned("/v1/completions", 0, None, (100, 0.01), None)  # remote timed again
    assert place.handoff.samples == 1 and place.handoff.predict(100) == pytest.approx(0.01)


def test_d_takes_a_long_prompt_when_its_chunks_fit_the_itl_budget() -> None:
    """1,536 tokens at 0.5 ms each while D decodes four requests, a 100 ms budget: whole,
    the prefill would stall D's next step by 768 ms (remote, itl_budget); computed 128
    tokens a step beside the decodes (D's --long-prefill-token-threshold), each step is
    late by 64 ms, within the budget, and D computes it sooner than P."""
    clock = Clock()
    for chunk, where, reason in ((None, "remote", "itl_budget"), (128, "local", "sooner"),
                                 (512, "remote", "itl_budget")):
        place = Placement("auto", itl_slo_ms=100, clock=clock,  # type: ignore[arg-type]
                          decode_chunk=chunk)
        for n in (100, 1000):
            place.prefill.observe(n, n * 0.0005)
        place.handoff.observe(1536, 0.05)
        p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
        d.decodes = 4
        p.prefill_tokens = 400  # P a little behind: remote is later than local
        decision, ticket, _ = place.choose({"prompt": list(range(1536))}, "/v1/completions",
                                           p, d)
        assert (decision.where, decision.reason) == (where, reason), chunk
        e = decision.estimates
        assert e is not None and e.local_chunks == (1 if chunk is None else -(-1536 // chunk))
        ticket.close(clock.now, learn=False)
