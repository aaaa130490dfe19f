"""Adaptive disaggregation: the rule, the estimators, and the proxy deciding with fakes."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import replace

import pytest
from pydantic import ValidationError

from appliance.proxy.access import AccessRecord as Record
from appliance.proxy.nodes.backends import Backend
from appliance.proxy.placement import Decision, Estimates, Placement, Ticket, decide
from appliance.proxy.placement.costmodel import Linear, StepTimes, TokensPerChar, prompt_size
from appliance.proxy.prefix.cache import Lookup
from appliance.proxy.settings import load_settings
from tests.proxy.conftest import MakeCluster


def E(remote: float | None, local: float | None, running: int = 0,
      budget: float | None = None) -> Estimates:
    return Estimates(100, remote, local, running, budget)


@pytest.mark.parametrize("estimates,local,reason", [
    (E(None, None), False, "unmeasured"),
    (E(None, 0.1), False, "unmeasured"),
    (E(0.3, 0.2), True, "sooner"),          # idle D: no transfer, sooner
    (E(0.2, 0.3), False, "sooner"),         # D busier prefilling than P
    (E(0.2, 0.2), True, "sooner"),          # a tie stays on D: P and the link stay free
    (E(0.3, 0.2, running=4, budget=0.05), False, "itl_budget"),  # 4 x 0.15 s of stall
    (E(0.3, 0.04, running=4, budget=0.05), True, "sooner"),      # within the budget
    (E(5.0, 0.2, running=4, budget=0.05), True, "backlog"),      # P far behind
    (E(0.3, 0.2, running=1, budget=None), False, "itl_budget"),  # no budget known: 0
])
def test_the_rule(estimates: Estimates, local: bool, reason: str) -> None:
    d = decide("auto", estimates)
    assert (d.local, d.reason) == (local, reason)


def A(local: float, alone: float, running: int, p_decodes: int = 0, fit: bool = True,
      remote: float = 0.3) -> Estimates:
    return Estimates(100, remote, local, running, 0.05, alone, p_decodes, fit)


@pytest.mark.parametrize("estimates,where,reason", [
    (A(0.02, 0.02, running=2), "p_alone", "balance"),            # D decodes 2, P none
    (A(0.02, 0.02, running=2, p_decodes=2), "local", "sooner"),  # even: D, within budget
    (A(0.02, 0.02, running=2, fit=False), "local", "sooner"),    # P does long prefills
    (A(0.02, 0.02, running=0), "local", "sooner"),               # idle D stays first
    (A(0.02, 0.04, running=2), "p_alone", "balance"),            # later, within the budget
    (A(0.02, 5.0, running=2), "local", "sooner"),                # P backed up
    (A(0.2, 0.2, running=2, fit=False), "remote", "itl_budget"),
    # Remote's prefill would stall P's 3 whole requests too (0.15 s each): D's stall (2 x
    # 0.15 s) is the smaller cost.
    (A(0.2, 0.2, running=2, p_decodes=3, fit=False), "local", "backlog"),
])
def test_the_rule_with_p_alone(estimates: Estimates, where: str, reason: str) -> None:
    d = decide("auto", estimates)
    assert (d.where, d.reason) == (where, reason)
    assert d.local == (where != "remote")


def test_a_p_that_would_not_answer_within_the_proxys_wait_is_not_asked() -> None:
    """Remote would end on D alone after the proxy's prefill wait (appliance.deadlines):
    D now, even when D is the slower of the two and busy decoding."""
    e = Estimates(100, 31.0, 40.0, 4, 0.05, alone_s=30.5, prefill_deadline_s=30.0)
    assert (decide("auto", e).where, decide("auto", e).reason) == ("local", "backlog")
    assert decide("auto", replace(e, alone_s=29.0)).where == "remote"  # P answers in time
    assert decide("always", e).where == "remote"  # the policy asked for it


def test_policies_ignore_estimates() -> None:
    assert decide("always", E(9, 0.1)).where == "remote"
    assert decide("never", E(0.1, 9, running=8)).where == "local"
    assert decide("always", E(9, 0.1)).reason == decide("never", E(1, 1)).reason == "policy"


def test_linear_fits_fixed_and_per_token_cost() -> None:
    line = Linear()
    assert line.predict(100) is None
    for n in (100, 400, 800, 1600, 200, 1200):
        line.observe(n, 0.02 + n * 0.0005)
    a, b = line.coefficients()  # type: ignore[misc]
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)
    assert line.predict(1000) == pytest.approx(0.52)


def test_linear_without_spread_is_proportional_and_follows_change() -> None:
    line = Linear()
    line.observe(100, 0.1)
    assert line.predict(200) == pytest.approx(0.2)
    for _ in range(60):  # the node got twice as slow: the old samples fade
        line.observe(100, 0.2)
    assert line.predict(100) == pytest.approx(0.2, rel=0.01)


def test_tokens_per_char_learns_from_usage() -> None:
    t = TokensPerChar()
    assert t.ratio == t.prior
    t.observe(chars=400, tokens=100)
    t.observe(chars=0, tokens=5)  # ignored
    assert t.ratio == pytest.approx(0.25)


def test_step_times_base_is_a_low_quantile() -> None:
    s = StepTimes(window=8)
    assert s.base() is None
    for v in (0.01, 0.01, 0.011, 0.012, 0.2, 0.3, 0.01, 0.5, 0.01, 0.01):
        s.observe(v)
    assert s.base() == pytest.approx(0.01)


@pytest.mark.parametrize("route,body,size", [
    ("/v1/completions", {"prompt": "abcd"}, (0, 4)),
    ("/v1/completions", {"prompt": [5, 6, 7]}, (3, 0)),
    ("/v1/completions", {"prompt": ["ab", "cde"]}, (0, 5)),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, (3, 0)),
    ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "abc"},
        {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "image_url"}]},
        "junk"]}, (0, 5)),
])
def test_prompt_size(route: str, body: dict, size: tuple[int, int]) -> None:
    assert prompt_size(body, route) == size


def test_queued_work_moves_requests_off_a_backed_up_p() -> None:
    place = Placement("auto", itl_slo_ms=None)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    d.in_flight = 1  # the request being placed (admission counted it)
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.01)
    first, t1, _ = place.choose({"prompt": list(range(100))}, "/v1/completions", p, d)
    assert (first.where, first.reason) == ("local", "sooner")
    assert d.prefill_tokens == 100 and t1.ahead == 0
    # D now prefills 5,000 tokens: the next request is sooner on P.
    d.prefill_tokens = 5000
    second, t2, _ = place.choose({"prompt": list(range(100))}, "/v1/completions", p, d)
    assert (second.where, second.reason) == ("remote", "sooner")
    assert p.prefill_tokens == 100 and t2.ahead == 0
    t2.close(0.0, learn=False)
    t2.close(0.0, learn=False)  # once only
    assert p.prefill_tokens == 0
    place.forget(p.url)
    assert p.url not in place._queues


def test_a_burst_of_long_prompts_is_spread_over_p_and_d() -> None:
    """Eight 512-token prompts at once (a chat's first turns). D's first one is still
    prefilling when the next come, so no decode of D's is stalled by a second prefill
    there: the prompts are shared between the nodes by their queues, not all sent to P."""
    place = Placement("auto", itl_slo_ms=50)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (128, 512, 1024):
        place.prefill.observe(n, 0.075 + n * 0.0006)
    place.handoff.observe(512, 0.1)
    placed = []
    for _ in range(8):
        decision, _, _ = place.choose({"prompt": list(range(512)), "stream": True},
                                      "/v1/completions", p, d)
        placed.append(decision.where)
        (p if decision.on_prefill else d).decodes += 1
    computed_on_p = sum(1 for w in placed if w != "local")
    assert 3 <= computed_on_p <= 5, placed
    assert (d.decoding, p.decoding) == (0, 0)  # every one waits for its prompt
    assert d.prefilling + p.prefilling == 8


@pytest.mark.parametrize("p_tokens,local_tokens,stalled", [(200, 600, 1), (3000, 100, 0)])
def test_a_remote_request_whose_kv_reaches_d_during_a_local_prefill_is_stalled_by_it(
        p_tokens: int, local_tokens: int, stalled: int) -> None:
    """A request waiting for P's prefill decodes on D from P's answer on: a local prefill
    still running then stalls it (P's 200 tokens end before D's 600 would), one that ends
    first does not (D's 100 tokens, P's 3,000)."""
    place = Placement("auto", itl_slo_ms=50)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 500, 1000):
        place.prefill.observe(n, 0.05 + n * 0.001)
    now = 100.0
    queue = place._queues.setdefault(p.url, {})
    waiting = Ticket(p, place.prefill, p_tokens, 0, 0, now, queue, d)
    queue[waiting] = None
    d.decodes, d.prefilling = 1, 1
    assert d.decoding == 0
    assert place.estimates(local_tokens, p, d, now).decodes_running == stalled


def test_a_request_decodes_once_its_prompt_is_computed() -> None:
    """`prefilling` counts a stream until its first token (a remote one until P's answer);
    a whole local answer counts as decoding from the start (its end is all the proxy sees)."""
    place = Placement("auto", itl_slo_ms=None)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for stream in (True, False):
        decision, ticket, _ = place.choose({"prompt": [1, 2], "stream": stream},
                                           "/v1/completions", p, d)
        assert decision.where == "remote"  # unmeasured
        d.decodes += 1
        assert d.decoding == 0
        ticket.close(0.0, learn=False)
        assert d.decoding == 1
        d.decodes -= 1
    place = Placement("never", itl_slo_ms=None)
    _, ticket, _ = place.choose({"prompt": [1, 2]}, "/v1/completions", p, d)
    d.decodes += 1
    assert d.decoding == 1
    ticket.close(0.0, learn=False)
    assert (d.decoding, d.prefilling) == (1, 0)


@pytest.mark.parametrize("tokens,fits", [(150, True), (390, True), (600, False)])
def test_p_decodes_whole_requests_only_while_its_prefills_are_short(tokens: int,
                                                                     fits: bool) -> None:
    """The ITL budget is 0.1 s; P takes whole requests while its recent prefills are within
    four times that (short prompts, or mostly cached ones: the load is decodes), not once a
    longer one came."""
    place = Placement("auto", itl_slo_ms=100)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)  # 1 ms a token
    place.handoff.observe(100, 0.01)
    d.decodes = 3  # D decodes three requests, P none
    _, ticket, _ = place.choose({"prompt": list(range(tokens))}, "/v1/completions", p, d)
    ticket.close(0.0, learn=False)  # that prompt's prefill is done
    e = place.estimates(100, p, d, 0.0)
    assert e.p_prefills_fit is fits
    assert (decide("auto", e).where == "p_alone") is fits


@pytest.mark.parametrize("long_prompts,fits", [(1, True), (6, True), (7, False)])
def test_a_few_long_prompts_among_short_ones_leave_p_serving_whole_requests(
        long_prompts: int, fits: bool) -> None:
    """A cold shared prefix or a conversation's first turn is one long prefill among many
    short ones: P keeps taking whole requests while three in five of the latest 16 prompts
    were short, not once two in five of them were long; a long prompt itself is P's alone
    only while nothing decodes on P (its prefill would stall P's decodes)."""
    place = Placement("auto", itl_slo_ms=100)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)  # 1 ms a token: fits within 400 tokens
    place.handoff.observe(100, 0.01)
    d.decodes = 3
    for i in range(16):
        tokens = 900 if i < long_prompts else 120
        _, ticket, _ = place.choose({"prompt": list(range(tokens))}, "/v1/completions", p, d)
        ticket.close(0.0, learn=False)
    assert place.estimates(100, p, d, 0.0).p_prefills_fit is fits
    assert place.estimates(900, p, d, 0.0).p_prefills_fit is fits  # P decodes nothing
    p.decodes = 1
    assert place.estimates(900, p, d, 0.0).p_prefills_fit is False


def test_a_short_prompt_stalls_ds_decodes_by_its_compute_not_its_fixed_costs() -> None:
    """Measured here: P's answers take 150 ms + 0.35 ms a token, D's unstalled budget is
    128 ms. A 128-token prompt adds ~45 ms of compute to D's steps (within the budget),
    though its first token takes ~195 ms: it goes local. A 1,000-token one (350 ms of
    compute) stalls D's four decodes: P, decoding one, takes it whole (within four
    budgets); a 2,000-token one (700 ms, past four budgets) goes remote, P prefilling only."""
    place = Placement("auto", itl_slo_ms=128)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 400, 1000, 1600):
        place.prefill.observe(n, 0.15 + n * 0.00035)
        place.handoff.observe(n, 0.15 + n * 0.00001)
    d.decodes = p.decodes = 4  # even: no P alone
    short = place.estimates(128, p, d, 0.0)
    assert short.local_s is not None and short.local_s > 0.128
    assert short.local_stall_s == pytest.approx(0.0448)
    assert decide("auto", short).where == "local"
    p.decodes = 1
    assert decide("auto", place.estimates(1000, p, d, 0.0)).where == "p_alone"
    assert decide("auto", place.estimates(2000, p, d, 0.0)).where == "remote"


def test_prompts_d_had_cached_count_as_short_for_ps_share() -> None:
    """A conversation's turns served by D from its own cache are short prefills, though P
    holds none of them: they do not make the workload one of long prompts for P."""
    place = Placement("auto", itl_slo_ms=100)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.01)
    for _ in range(16):
        d.decodes = 0  # an idle D: each turn is local, 100 of its 900 tokens uncached on D
        turn = Lookup(900, {d.url: 800})
        decision, ticket, _ = place.choose({"prompt": "x"}, "/v1/completions", p, d, turn)
        assert decision.where == "local"
        ticket.close(0.0, learn=False)
    d.decodes = 3
    assert place.estimates(120, p, d, 0.0).p_prefills_fit  # a new conversation's turn fits


@pytest.mark.parametrize("computed_on,fits", [("d", True), ("p", False)])
def test_only_the_long_prefills_p_computed_keep_it_from_whole_requests(
        computed_on: str, fits: bool) -> None:
    """Eight long first turns, then short later turns: long prompts that D computed stall
    none of P's whole requests, so P may take the next short turns whole at once (D held
    every conversation's decode for half a round otherwise); long ones P computed do."""
    place = Placement("auto", itl_slo_ms=100)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.01)
    busy = p if computed_on == "d" else d  # the other node is far behind: not chosen
    busy.prefill_tokens = 20_000
    for _ in range(8):
        decision, ticket, _ = place.choose({"prompt": list(range(600))}, "/v1/completions",
                                           p, d)
        assert (decision.where == "local") is (computed_on == "d")
        ticket.close(0.0, learn=False)
    busy.prefill_tokens = 0
    d.decodes = 3
    assert place.estimates(120, p, d, 0.0).p_prefills_fit is fits


def _burst(order: str) -> dict[str, int]:
    """The prompt tokens P and D compute for a burst of 896-token prompts on 768-token
    prefixes (`order`: each prompt's prefix), after short ones, as the proxy places them."""
    place = Placement("auto", itl_slo_ms=83)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (128, 512, 1024):  # the line measured on bench/serve.py's prefix workload
        place.prefill.observe(n, 0.122 + n * 0.000717)
    place.handoff.observe(896, 0.25)
    for _ in range(16):
        place._prompts.append(128)
    holds: dict[str, set[str]] = {}
    work = {"p": 0, "d": 0}
    for prefix in order:
        on = holds.setdefault(prefix, set())  # where it is computed (the expected blocks)
        lookup = Lookup(896, {b.url: 768 if b.url in on else 0 for b in (p, d)})
        decision, _, _ = place.choose({"prompt": "x", "stream": True}, "/v1/completions",
                                      p, d, lookup)
        node = d if decision.where == "local" else p
        work[node.role[0]] += 896 - lookup.on(node.url)
        on.add(node.url)
        (p if decision.on_prefill else d).decodes += 1
    return work


@pytest.mark.parametrize("order", ["ABCDABCD", "AABBCCDD", "ABACBDCD", "ABCADBCD"])
def test_a_burst_on_new_prefixes_computes_each_prefix_once(
        order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight prompts at once on four new prefixes (bench/serve.py's prefix workload): the
    prompts of one prefix go where its first is computed, so the node computes each prefix
    once, as the one server does, split evenly between P and D. Without the share of work
    done twice (the rule as it was), a prompt went wherever it would start a few ms sooner,
    and the node computed prefixes on both (measured on that workload: the burst ended
    0.4 s after the one server's)."""
    assert _burst(order) == {"p": 2048, "d": 2048}  # 4 x 768 + 8 x 128, halved
    monkeypatch.setattr("appliance.proxy.placement.decision.DUPLICATE_SHARE", 0.0)
    if order == "AABBCCDD":
        assert _burst(order) == {"p": 3584, "d": 3584}


def test_work_done_twice_counts_half_against_a_placement() -> None:
    """D holds 768 of the prompt's 896 tokens; P is idle and D has 800 tokens queued. P
    alone would answer first (896 tokens against D's 928), but computes 768 tokens D
    already holds: half of that compute (0.384 s) counts against it, and D takes it."""
    place = Placement("auto", itl_slo_ms=100)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
    for n in (100, 1000):
        place.prefill.observe(n, n * 0.001)
    place.handoff.observe(100, 0.01)
    d.decodes, d.prefill_tokens = 3, 800
    e = place.estimates(896, p, d, 0.0, cached_p=0, cached_d=768)
    assert (e.p_dup_s, e.d_dup_s) == (pytest.approx(0.384), 0.0)
    assert e.alone_s is not None and e.local_s is not None and e.alone_s < e.local_s
    assert decide("auto", replace(e, decodes_running=0)).where == "local"
    assert decide("auto", replace(e, decodes_running=0, p_dup_s=0.0)).where == "p_alone"
    # D far behind (3,000 tokens queued): P computes it, prefix and all.
    d.prefill_tokens = 3000
    e = place.estimates(896, p, d, 0.0, cached_p=0, cached_d=768)
    assert decide("auto", replace(e, decodes_running=0)).where != "local"


def test_the_access_line_shows_work_done_twice() -> None:
    rec = Record("/v1/completions", "r1", 0.0)
    e = Estimates(896, 0.9, 0.2, 1, 0.08, 0.3, 0, True, p_dup_s=0.276)
    rec.placed = Decision("local", "sooner", 896, 0, 768, e)
    assert rec._weighed().endswith(" decodes=0/1 dup_ms=p:276,d:0")
    rec.placed = Decision("local", "sooner", 896, 0, 0, replace(e, p_dup_s=0.0))
    assert rec._weighed().endswith(" decodes=0/1")  # nothing held twice: no field


def test_settings_refuse_bad_values_in_one_line() -> None:
    with pytest.raises(SystemExit):
        load_settings(["--split", "sometimes"])
    with pytest.raises(ValidationError, match="itl_slo_ms"):
        load_settings(["--itl-slo-ms", "0"])
    with pytest.raises(ValidationError, match="kv_block_size"):
        load_settings(["--kv-block-size", "0"])
    assert load_settings([]).split == "auto"


async def _decoding(c, node: str = "decode") -> None:
    """Until the node streams its request's tokens: its prompt is computed, and a prefill
    there now would stall its steps."""
    for _ in range(200):
        (b,) = (await c.status())[node]
        if b["decodes"] and not b["prefilling"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{node} never decoded")


async def _stream(c, prompt: str = "hello there") -> int:
    async with c.http.post(f"{c.url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}) as r:
        await r.read()
        return r.status


async def test_never_serves_by_d_alone_and_p_holds_nothing(make_cluster: MakeCluster,
                                                         caplog) -> None:
    c = await make_cluster(split="never")
    caplog.set_level(logging.INFO, logger="appliance.proxy.access")
    status, data, _ = await c.post()
    assert status == 200 and data["choices"][0]["text"] == "t0 t1 t2 t3"
    assert c.prefill[0].received == [] and c.released() == []
    (got,) = c.decode[0].bodies()
    assert "kv_transfer_params" not in got
    assert "split=local:policy" in caplog.text and "fallback" not in caplog.text
    assert "est_ms" not in caplog.text  # a fixed policy weighs nothing
    metrics = await c.metrics()
    assert 'pd_proxy_split_decisions_total{decision="local",reason="policy"} 1.0' in metrics
    assert "pd_proxy_prefill_fallbacks_total" not in metrics.split("# TYPE pd_proxy_prefill_"
                                                                   "fallbacks")[-1][:200]
    status_body = await c.status()
    assert status_body["split"]["policy"] == "never"
    assert status_body["split"]["last_minute"] == {"remote": 0, "local": 1, "p_alone": 0}
    assert status_body["decode"][0]["prefill_tokens"] == 0


async def test_auto_learns_then_keeps_an_idle_node_local(make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="auto")
    c.prefill[0].delay = 0.2
    assert await _stream(c) == 200  # nothing measured yet: P is asked, and timed
    assert len(c.prefill[0].received) == 1
    assert await _stream(c) == 200  # D idle: sooner without the handoff
    assert len(c.prefill[0].received) == 1 and len(c.decode[0].received) == 2
    split = (await c.status())["split"]
    assert split["last_minute"] == {"remote": 1, "local": 1, "p_alone": 0}
    assert split["prefill"]["samples"] == 2  # P's answer, then D's first token
    assert split["handoff"]["samples"] == 1
    metrics = await c.metrics()
    for decision, reason in (("remote", "unmeasured"), ("local", "sooner")):
        assert (f'pd_proxy_split_decisions_total{{decision="{decision}",reason="{reason}"}} '
                "1.0") in metrics


async def test_auto_keeps_long_prefills_off_a_decoding_d(make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="auto", itl_slo_ms=1)
    c.prefill[0].delay = 0.1
    assert await _stream(c) == 200  # learns P: 0.1 s for its 5 tokens
    # D prefills as slowly as P (its first token after 0.1 s) and then decodes for 2 s.
    c.decode[0].delay, c.decode[0].chunks, c.decode[0].chunk_delay = 0.1, 40, 0.05
    running = asyncio.create_task(_stream(c))  # local: D is idle
    await _decoding(c)
    c.decode[0].chunks, c.decode[0].chunk_delay = 4, 0.0
    # D is decoding: a 0.1 s prefill there would stall that stream 100x its budget.
    assert await _stream(c) == 200
    assert len(c.prefill[0].received) == 2
    assert await running == 200
    metrics = await c.metrics()
    assert 'pd_proxy_split_decisions_total{decision="remote",reason="itl_budget"} 1.0' \
        in metrics


async def test_auto_sends_new_requests_to_d_while_p_is_frozen(make_cluster: MakeCluster) -> None:
    c = await make_cluster(split="auto", itl_slo_ms=1, prefill_timeout_s=30)
    c.prefill[0].delay = 0.1
    assert await _stream(c) == 200  # learns P: 0.1 s
    c.decode[0].delay, c.decode[0].chunks, c.decode[0].chunk_delay = 0.1, 200, 0.02
    decoding = asyncio.create_task(_stream(c))  # local (0.1 s, as P), keeps D busy
    await c.decode[0].wait_requests(2)
    c.prefill[0].hang = True  # P answers nothing now (its health checks still pass)
    stuck = asyncio.create_task(_stream(c))  # 0.1 s on D is past the budget: remote, stuck
    await c.prefill[0].wait_requests(2)
    await asyncio.sleep(0.5)
    # The stuck prefill has waited 0.5 s: that outweighs stalling D's decodes.
    status, _, took = await c.post(body={"model": "tiny", "prompt": "hello there",
                                                "max_tokens": 4})
    assert status == 200 and took < 2
    assert len(c.prefill[0].received) == 2
    metrics = await c.metrics()
    assert 'pd_proxy_split_decisions_total{decision="local",reason="backlog"} 1.0' in metrics
    stuck.cancel()
    decoding.cancel()


async def test_auto_serves_whole_requests_on_p_while_d_decodes_more(
        make_cluster: MakeCluster, caplog) -> None:
    c = await make_cluster(split="auto", itl_slo_ms=500)
    assert await _stream(c) == 200  # learns P: its prefills are short
    c.decode[0].chunks, c.decode[0].chunk_delay = 60, 0.05
    decoding = asyncio.create_task(_stream(c))  # local: D is idle
    await c.decode[0].wait_requests(2)
    caplog.set_level(logging.INFO, logger="appliance.proxy.access")
    c.decode[0].chunks, c.decode[0].chunk_delay = 4, 0.0
    # D decodes one request, P none: P serves the next one whole, as the client sent it.
    status, data, _ = await c.post()
    assert status == 200 and data["choices"][0]["text"] == "t0 t1 t2 t3"
    got = c.prefill[0].bodies()[-1]
    assert "kv_transfer_params" not in got and got["max_tokens"] == 8
    assert len(c.decode[0].received) == 2 and c.released() == []
    assert "split=p_alone:balance" in caplog.text
    # What auto weighed is on the line: each placement's first token, the budget (500 ms),
    # the decodes running on P and D.
    assert re.search(r" est_ms=remote:\d+,local:\d+,p_alone:\d+ budget_ms=500 decodes=0/1 ",
                     caplog.text)
    metrics = await c.metrics()
    assert 'pd_proxy_split_decisions_total{decision="p_alone",reason="balance"} 1.0' in metrics
    status_body = await c.status()
    assert status_body["split"]["last_minute"]["p_alone"] == 1
    # Over: P holds nothing; D still decodes the long stream.
    (p,), (d,) = status_body["prefill"], status_body["decode"]
    assert (p["in_flight"], p["decodes"], d["in_flight"], d["decodes"]) == (0, 0, 1, 1)
    assert await decoding == 200
