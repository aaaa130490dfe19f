"""The rule of adaptive disaggregation, pure: what one decision weighs (`Estimates`, filled
in by appliance.proxy.placement.decision), the decision (`Decision`) and `decide`, the
rule itself; the tests and the benchmark read it as written here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from appliance.proxy.settings import Split

Where = Literal["remote", "local", "p_alone"]


@dataclass(frozen=True, slots=True)
class Estimates:
    """What one decision weighs, in seconds until the first token (None: not measured)."""

    tokens: int
    remote_s: float | None
    local_s: float | None
    # Requests decoding on D: a local prefill stalls each one's decode steps (those still
    # waiting for their prompt's KV are not stalled: their wait is in the estimates).
    decodes_running: int
    itl_budget_s: float | None
    # P alone: its first token (P's prefill, no handoff), the whole requests decoding on P
    # (stalled by its prefills), and whether the prefill of every recent prompt fits the
    # ITL budget.
    alone_s: float | None = None
    p_decodes: int = 0
    p_prefills_fit: bool = False
    # What the prompt's prefill adds to the steps of the decodes running beside it: its
    # compute (the fitted line's per-token part), not the first token's fixed costs (HTTP,
    # scheduling, the first step), which those decodes do not wait for. None: take the
    # whole first-token time.
    local_stall_s: float | None = None
    alone_stall_s: float | None = None
    # How long the proxy waits for P's answer (appliance.deadlines).
    prefill_deadline_s: float | None = None
    # The requests placed on each node and not done, decoding or about to: what P alone
    # balances (None: the decoding counts above).
    p_placed: int | None = None
    d_placed: int | None = None
    # Computing on P (P alone, remote) or on D (local) the prompt's tokens that the other
    # node's cache holds: DUPLICATE_SHARE of that compute, added to the estimate it weighs.
    p_dup_s: float = 0.0
    d_dup_s: float = 0.0
    # What each request placed on D beyond P's costs in decode steps, this one's and the
    # others' (2 x its output tokens x a step's time per request); 0 unless measured.
    decode_per_request_s: float = 0.0
    # The decode steps of D's that a local prefill stalls: its chunks, each stalling one
    # step by `local_stall_s` (1: D computes the prompt in one step).
    local_chunks: int = 1

    def placed(self) -> tuple[int, int]:
        """The requests placed on P and on D (the decoding counts when not given)."""
        return (self.p_decodes if self.p_placed is None else self.p_placed,
                self.decodes_running if self.d_placed is None else self.d_placed)

    @property
    def decode_gain_s(self) -> float:
        """What decoding on P rather than on D, which holds more requests, saves."""
        p, d = self.placed()
        return self.decode_per_request_s * max(0, d - p)


@dataclass(frozen=True, slots=True)
class Decision:
    where: Where
    # policy: split=always/never; unmeasured: auto has no timing of P yet (it learns);
    # itl_budget: local would stall D's decodes longer than remote delays this request;
    # backlog: it would, but P is so far behind that the request waits less on D (or P
    #     would not answer before the proxy's prefill deadline);
    # sooner: no decode to stall, the faster of the two;
    # balance: P alone, as D decodes more requests than P and P's prefills are short.
    reason: str
    tokens: int = 0
    # The prompt's tokens P's and D's caches hold (the prefix index; 0: not predicted).
    cached_p: int = 0
    cached_d: int = 0
    # What `auto` weighed (None for the fixed policies): the access line shows it.
    estimates: Estimates | None = None

    @property
    def local(self) -> bool:
        """No KV moves: one node serves the whole request."""
        return self.where != "remote"

    @property
    def on_prefill(self) -> bool:
        return self.where == "p_alone"


def decide(split: Split, e: Estimates) -> Decision:
    """The rule, pure: the tests and the benchmark read it as written here.

    With decodes running on D, a local prefill taking longer than the ITL budget costs
    each of them the excess on one token; remote costs this request the difference in
    first-token time. The smaller cost, in seconds of someone's wait, wins."""
    if split == "always":
        return Decision("remote", "policy", e.tokens)
    if split == "never":
        return Decision("local", "policy", e.tokens)
    if e.remote_s is None or e.local_s is None:
        return Decision("remote", "unmeasured", e.tokens)
    if (e.prefill_deadline_s is not None and e.alone_s is not None
            and e.alone_s > e.prefill_deadline_s):
        # P would not answer before the proxy stops waiting: remote would end on D alone
        # anyway, after that wait, and P's work (if it started) thrown away.
        return Decision("local", "backlog", e.tokens)
    budget = e.itl_budget_s or 0.0
    p_placed, d_placed = e.placed()
    # What each placement costs: its first token, and its share of work done twice.
    local, remote = e.local_s + e.d_dup_s, e.remote_s + e.p_dup_s
    # D's decodes outnumber P's, or they are even and P's cache holds more of the prompt:
    # its alternatives compute on P all the same (remote), or twice (local). Ties to D
    # alone would send P's overflow to D, and D's never to P (measured: D decoded 60% of a
    # shared-prefix workload whose prefixes were split evenly).
    fewer = p_placed < d_placed or (p_placed == d_placed and e.d_dup_s > 0)
    if (e.alone_s is not None and e.p_prefills_fit and fewer
            and e.alone_s + e.p_dup_s <= max(budget, local + e.decode_gain_s)):
        # P takes this one whole, no later than D would start it (or later by what its
        # decode steps beside fewer requests save).
        return Decision("p_alone", "balance", e.tokens)
    d_adds = e.local_s if e.local_stall_s is None else e.local_stall_s
    if e.decodes_running and d_adds > budget:
        # Each chunk's step is late by the excess, for each decode running.
        stall = (d_adds - budget) * e.decodes_running * e.local_chunks
        # Remote's prefill stalls P's decodes (whole requests P serves) likewise.
        p_adds = e.alone_s if e.alone_stall_s is None else e.alone_stall_s
        p_stall = max(0.0, (p_adds or 0.0) - budget) * e.p_decodes
        if remote + p_stall - local > stall:
            return Decision("local", "backlog", e.tokens)
        return Decision("remote", "itl_budget", e.tokens)
    return Decision("local" if local <= remote else "remote", "sooner", e.tokens)


def chunked(tokens: int, chunk: int | None) -> tuple[int, int]:
    """(the tokens of a prefill's largest step, its steps) when computed `chunk` tokens a
    step beside running decodes (None: in one step)."""
    if chunk is None or tokens <= chunk:
        return tokens, 1
    return chunk, -(-tokens // chunk)


def serve_whole(reason: str, where: Where | None = None) -> Callable[[Decision], Decision]:
    """An overrule for a request one node must serve whole (`reason` on the access line):
    at `where`, else D alone where the policy would split it (P alone only where the policy
    prefers it)."""
    def whole(decision: Decision) -> Decision:
        if where is not None:
            return Decision(where, reason, decision.tokens)
        if decision.where == "remote":
            return Decision("local", reason, decision.tokens)
        return decision
    return whole
