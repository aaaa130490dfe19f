"""Adaptive disaggregation: where one request's prompt is prefilled, decided once, before
the exchange picks a path.

- `remote`: P prefills and its KV goes to D (the split and first-token paths);
- `local`: D alone prefills and decodes; P is not called and holds nothing;
- `p_alone`: P alone prefills and decodes, so a node whose load is decodes uses both
  engines for them (no KV moves, D is not called).

Policy `split`: `always` (every request remote), `never` (every one local) or `auto`: the
sooner of the two by the node's own measurements, unless a local prefill would stall D's
running decodes past the ITL budget (by its compute, the fitted line's per-token part: the
fixed part of a first token is HTTP and scheduling, which those decodes do not wait for);
P serves whole requests while D decodes more of them than P does (or as many, when P's
cache holds more of the prompt) and its recent prefills are short (this prompt's, and
three in five of the latest prompts' as P computed them, D's counting as none: within four
budgets; a P that is asked for long prefills decodes nothing, so they stall no one). What
`auto` weighs (appliance.proxy.placement.costmodel):

- the prompt's tokens that each node would compute: exact when the prefix index has
  them (appliance.proxy.prefix: the engines' own KV events, the prompt's ids from
  /tokenize), less what that node's cache holds; else characters times the tokens per
  character the engines' usage counts showed, none cached;
- the prefill work already sent to P and to D and not done yet (tokens), so a backed-up P
  sends new requests to D, and a D busy prefilling sends them to P; with what each engine
  waits on and runs beyond this proxy's own requests (appliance.proxy.nodes.engineload:
  other proxies in front of the same engines), a request waiting counted as a prompt of
  the recent mean size, one running as a decode;
- prefill seconds as one line in (work ahead in the node's queue + own tokens), fitted
  from P's answer times and D's first tokens on local streams: P and D run one model, so
  their samples are pooled, and what tells them apart is the work queued on each (two
  lines from a few noisy samples each would decide an idle node by noise);
- the handoff (transfer + D's first step): D's first token after P's answer;
- the ITL budget: `itl_slo_ms`, or 3x D's unstalled time per streamed token;
- work done twice: a node that computes prompt tokens the other one's cache holds (a
  shared prefix, a conversation's history) spends compute the node as a whole did not
  need. Half of that compute is added to its estimate: each engine would otherwise have
  had its half of it for the requests behind. Without it, a burst of prompts on a few new
  prefixes goes to whichever node is free a few ms sooner, each prefix is computed on both,
  and the burst ends later than on the one server, which computes each prefix once;
- decode steps: a step's time grows with the requests in it (a line fitted from the
  streams' time per token against their node's requests); decoding on P rather than on a
  D that holds more saves this request's steps and those of D's others, so P alone may
  start later by what that saves (on a GPU the line is flat: nothing changes).

Every decision is counted by outcome and reason, written on the access line, and the
last minute's split is in /status.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from appliance.proxy.nodes.backends import Backend
from appliance.proxy.openai_api import CHAT, RESPONSES
from appliance.proxy.placement.costmodel import (
    Linear,
    Mean,
    StepTimes,
    TokensPerChar,
    prompt_size,
)
from appliance.proxy.placement.rule import Decision, Estimates, chunked, decide
from appliance.proxy.placement.tickets import Recent, Ticket, expire
from appliance.proxy.prefix.cache import Lookup
from appliance.proxy.settings import Split

# Without an itl_slo_ms, a local prefill may add up to this many of D's unstalled steps.
ITL_BUDGET_STEPS = 3.0
# P serves whole requests only while this prompt's prefill and those of P_ALONE_SHARE of
# the RECENT_PROMPTS latest fit P_ALONE_FIT times the budget: a node whose load is decodes
# (prompts mostly cached, or short) then decodes on both engines, as the one server it
# replaces does with both of its devices, and P's whole requests are stalled only by
# prefills about as short as that server's. A share, not all of them: the first turn of a
# conversation or a cold shared prefix is one long prefill among many short ones, which
# stalls P's decodes once (as it would the one server's), and must not keep P to prefills
# for the next sixteen requests; a workload of long prompts keeps it there.
RECENT_PROMPTS = 16
# Four budgets, not two: on one core a conversation's next turn (its new message and the
# last answer) computes in about two, and D decoded nearly every conversation (README).
P_ALONE_FIT = 4.0
P_ALONE_SHARE = 0.6
# The handoff line forgets half its weight in this long without a new sample (a line of
# one sample is gone in two), and a sample counts as at most this many times the line.
HANDOFF_HALF_LIFE_S = 30.0
HANDOFF_CLIP = 4.0
# The share of the compute spent on tokens the other node holds that counts against a
# placement (the module's doc): one of the node's two engines' worth.
DUPLICATE_SHARE = 0.5

_TEMPLATED = (CHAT, RESPONSES)  # prompts rendered by the chat template: one tokens per char


class Placement:
    """The measurements and the decision; the proxy asks `choose` once per request."""

    def __init__(self, split: Split, itl_slo_ms: float | None,
                 prefill_deadline_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 decode_chunk: int | None = None) -> None:
        self.split = split
        self.decode_chunk = decode_chunk  # D's prefill chunk while it decodes (None: whole)
        self.clock = clock
        self.prefill_deadline_s = prefill_deadline_s
        self.itl_slo_s = None if itl_slo_ms is None else itl_slo_ms / 1000
        self.prefill = Linear()  # P's and D's prefills, pooled (see the module's doc)
        # P's answer -> D's first token, in the prompt's tokens. Only remote streams time
        # it, so an outlier that turns remote off would stay: it forgets with time too, and
        # a sample far above the line counts as HANDOFF_CLIP times it.
        self.handoff = Linear(half_life_s=HANDOFF_HALF_LIFE_S, clip=HANDOFF_CLIP)
        self.steps = StepTimes()
        self.step_line = Linear()  # seconds per streamed token against the node's requests
        self.output = Mean()  # recent requests' output tokens
        self.work = Mean()  # recent prompts' tokens computed (what another's waiting costs)
        self.tokens_per_char = {route: TokensPerChar() for route in ("chat", "completions")}
        self.counts: dict[tuple[str, str], int] = {}
        self._recent = Recent()
        self._queues: dict[str, dict[Ticket, None]] = {}  # per node URL, oldest first
        # The tokens P computed for each of the latest prompts (0 for those D computed):
        # whether P is asked for long prefills, which would stall its whole requests (a
        # conversation cached on D, or a burst of first turns D computes, does not).
        self._prompts: deque[int] = deque(maxlen=RECENT_PROMPTS)

    def tokens(self, body: dict[str, Any], route: str) -> tuple[int, int]:
        """(estimated prompt tokens, characters of prompt text)."""
        ids, chars = prompt_size(body, route)
        ratio = self.tokens_per_char["chat" if route in _TEMPLATED else "completions"].ratio
        return max(1, ids + round(chars * ratio)), chars

    def forget(self, url: str) -> None:
        """A node dropped (it left and holds nothing): its queue goes with it."""
        self._queues.pop(url, None)

    def itl_budget_s(self) -> float | None:
        if self.itl_slo_s is not None:
            return self.itl_slo_s
        base = self.steps.base()
        return None if base is None else ITL_BUDGET_STEPS * base

    def _queued(self, b: Backend) -> int:
        """Prefill tokens sent to `b` and not done: this proxy's tickets, and the requests
        the engine waits on beyond those (each a prompt of the recent mean size)."""
        return b.prefill_tokens + round(b.others_waiting * (self.work.value or 0.0))

    def _waited(self, b: Backend, now: float) -> float:
        """How long the oldest prefill not done on `b` has waited: a request sent now ends
        after it (a frozen P's grows until it is found down)."""
        queue = self._queues.get(b.url)
        return now - next(iter(queue)).sent if queue else 0.0

    def estimates(self, tokens: int, p: Backend, d: Backend, now: float,
                  cached_p: int = 0, cached_d: int = 0, max_out: int | None = None) -> Estimates:
        """`tokens`: the prompt's; `cached_*`: those each node's prefix cache holds;
        `max_out`: the request's output token limit."""
        on_p, on_d = tokens - cached_p, tokens - cached_d
        p_line = self.prefill.predict(self._queued(p) + on_p)
        alone = remote = None  # P's first token; that plus the handoff
        if p_line is not None:
            alone = max(p_line, self._waited(p, now))
            # Until a stream has timed it, the handoff counts as free (remote's best case).
            # Only the blocks D lacks move.
            self.handoff.age(now)
            remote = alone + (self.handoff.predict(on_d) or 0.0)
        d_line = self.prefill.predict(self._queued(d) + on_d)
        local = None if d_line is None else max(d_line, self._waited(d, now))
        # D's decodes, and the remote requests whose KV reaches D while a local prefill
        # would still run there: those decode, stalled, from P's answer on.
        # Another's running requests decode there (or finish a prefill: stalled alike).
        p_decoding, d_decoding = p.decoding + p.others_running, d.decoding + d.others_running
        running = d_decoding + (0 if local is None else self._arriving(d, now + local))
        budget = self.itl_budget_s()
        fit = budget is not None and self._p_prefills_fit(on_p, P_ALONE_FIT * budget,
                                                          p_decoding == 0)
        step_tokens, chunks = chunked(on_d, self.decode_chunk)
        return Estimates(tokens, remote, local, running, budget, alone, p_decoding, fit,
                         self._compute(step_tokens), self._compute(on_p),
                         self.prefill_deadline_s, p.decodes + p.others_running,
                         d.decodes + d.others_running,
                         self._duplicate(cached_d - cached_p),
                         self._duplicate(cached_p - cached_d),
                         self._decode_per_request(max_out), chunks)

    def _decode_per_request(self, max_out: int | None) -> float:
        """Estimates.decode_per_request_s: the output a request is expected to have (its
        limit, or the recent requests' mean if less) x a step's time per request it holds."""
        slope = self.step_line.slope()
        if not slope:
            return 0.0
        out = min([x for x in (max_out, self.output.value) if x is not None], default=0.0)
        return 2.0 * out * slope

    def _arriving(self, d: Backend, by: float) -> int:
        """Requests waiting for a P's prefill (any P's) that D then decodes, P's answer due
        before `by` (each prefill's predicted end: sent + the line at the work it joined)."""
        n = 0
        for url, queue in self._queues.items():
            if url == d.url:  # D's own prefills: computed beside a local one, not stalled
                continue
            for t in queue:
                if t.serving is d and t.sent + (self.prefill.predict(t.ahead + t.tokens)
                                                or 0.0) < by:
                    n += 1
        return n

    def _compute(self, tokens: int) -> float | None:
        """The compute part of a prefill of `tokens` (see Estimates.local_stall_s)."""
        c = self.prefill.coefficients()
        return None if c is None else c[1] * tokens

    def _duplicate(self, tokens: int) -> float:
        """What computing `tokens` the other node holds costs (see Estimates.p_dup_s)."""
        return DUPLICATE_SHARE * (self._compute(tokens) or 0.0) if tokens > 0 else 0.0

    def _p_prefills_fit(self, on_p: int, limit_s: float, p_idle: bool) -> bool:
        """This prompt's prefill compute, and that of P_ALONE_SHARE of the latest, within
        `limit_s`: what P's whole requests would wait for, step by step. `p_idle`: nothing
        decodes on P, so this prompt's prefill stalls no one, however long (a burst of
        first turns is shared by P and D, each keeping its conversations)."""
        mine = self._compute(on_p)
        if mine is None or (mine > limit_s and not p_idle):
            return False
        short = sum(1 for n in self._prompts if (self._compute(n) or 0.0) <= limit_s)
        return short >= P_ALONE_SHARE * len(self._prompts)

    def choose(self, body: dict[str, Any], route: str, p: Backend, d: Backend,
               prefix: Lookup | None = None, size: tuple[int, int] | None = None,
               overrule: Callable[[Decision], Decision] | None = None
               ) -> tuple[Decision, Ticket, int]:
        """The decision, the ticket of the prefill it sends (to D for local, else to P),
        and the prompt's characters. `size`: `tokens(body, route)` when already known;
        `overrule`: the request's own limits on where it may go (one that must be served
        whole: appliance.proxy.responses)."""
        estimate, chars = self.tokens(body, route) if size is None else size
        tokens = estimate if prefix is None else prefix.tokens
        cached_p = 0 if prefix is None else prefix.on(p.url)
        cached_d = 0 if prefix is None else prefix.on(d.url)
        now = self.clock()
        expire(self._queues.values(), now)
        auto = self.split == "auto"
        limit = (body.get("max_completion_tokens") or body.get("max_tokens")
                 or body.get("max_output_tokens"))
        e = (self.estimates(tokens, p, d, now, cached_p, cached_d,
                            limit if isinstance(limit, int) else None) if auto
             else Estimates(tokens, None, None, 0, None))
        decision = decide(self.split, e)
        if overrule is not None:
            decision = overrule(decision)
        decision = replace(decision, cached_p=cached_p, cached_d=cached_d,
                           estimates=e if auto else None)
        key = (decision.where, decision.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        self._recent.add(decision.where, now)
        node, cached = (d, cached_d) if decision.where == "local" else (p, cached_p)
        queue = self._queues.setdefault(node.url, {})
        work = tokens - cached
        self.work.observe(work)
        self._prompts.append(work if node is p else 0)
        serving = p if decision.where == "p_alone" else d
        marks = decision.where == "remote" or body.get("stream") is True
        ahead = self._queued(node)
        ticket = Ticket(node, self.prefill, work, cached, ahead, now, queue,
                        serving if marks else None)
        if not marks and (line := self.prefill.predict(ahead + work)) is not None:
            ticket.due = now + line  # a whole local or P-alone answer
        queue[ticket] = None
        node.prefill_tokens += work
        if marks:
            serving.prefilling += 1
        return decision, ticket, chars

    def learned(self, route: str, chars: int, prompt_tokens: int | None,
                handoff: tuple[int, float] | None, step_s: float | None,
                batch: float | None = None, output_tokens: int | None = None) -> None:
        """What one finished request showed: its prompt's true size, the handoff of a
        remote stream (tokens, seconds), its node's time per streamed token and requests
        held meanwhile (their mean), its output tokens."""
        if prompt_tokens and chars:
            self.tokens_per_char["chat" if route in _TEMPLATED else "completions"].observe(
                chars, prompt_tokens)
        if handoff is not None:
            self.handoff.observe(*handoff, now=self.clock())
        if step_s is not None:
            self.steps.observe(step_s)
            if batch:
                self.step_line.observe(batch, step_s)
        if output_tokens:
            self.output.observe(output_tokens)

    def describe(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "policy": self.split,
            "last_minute": self._recent.totals(now),
            "itl_budget_ms": None if (b := self.itl_budget_s()) is None else round(b * 1000, 3),
            "prefill": self.prefill.describe(),
            "handoff": self.handoff.describe(),
            # Per streamed token, against the requests its node held (per 1k: per 1,000).
            "decode_step": self.step_line.describe(),
        }
