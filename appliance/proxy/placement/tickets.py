"""The prefills sent and not done (each one's ticket: its tokens count as work queued on
its node until it closes), and the last minute's decisions (/status)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from appliance.proxy.nodes.backends import Backend
from appliance.proxy.placement.costmodel import Linear

RECENT_S = 60


@dataclass(slots=True, eq=False)
class Ticket:
    """One prefill sent and not done: its tokens count as work queued on its node until
    closed (P's answer; D's first token of a local stream; the request's end; or, when
    none of those comes before the whole answer, its predicted end: `due`)."""

    backend: Backend
    model: Linear
    tokens: int  # the prompt's tokens this node computes (its cache holds `cached` more)
    cached: int
    ahead: int
    sent: float
    # The node's prefills not done, oldest first (shared by its tickets).
    queue: dict[Ticket, None]
    # The node that decodes the request, when the close marks its prompt computed (P's
    # answer; a stream's first token): counted in its `prefilling` until then. A whole
    # local answer's ticket closes only at its end, so it counts as decoding throughout.
    serving: Backend | None = None
    # When its prefill is predicted done, for a ticket whose end the proxy never sees
    # before the answer's (a whole local or P-alone answer: its first byte is its last):
    # past it, its tokens no longer count as queued (`expire`). None: closed when seen.
    due: float | None = None
    open: bool = True

    def close(self, now: float, learn: bool, tokens: int | None = None) -> None:
        if not self.open:
            return
        self.open = False
        self.queue.pop(self, None)
        self.backend.prefill_tokens -= self.tokens
        if self.serving is not None:
            self.serving.prefilling -= 1
        if learn:
            n = self.tokens if tokens is None else max(1, tokens - self.cached)
            self.model.observe(self.ahead + n, now - self.sent)


def expire(queues: Iterable[dict[Ticket, None]], now: float) -> None:
    """Closes the tickets past their `due`: a whole answer's prefill, predicted done, no
    longer holds its node's queue (else the node looks backlogged by the answer's age)."""
    for queue in queues:
        for ticket in [t for t in queue if t.due is not None and t.due <= now]:
            ticket.close(now, learn=False)


@dataclass
class Recent:
    """Decisions of the last minute, in one-second buckets."""

    buckets: deque[tuple[int, dict[str, int]]] = field(default_factory=deque)

    def add(self, where: str, now: float) -> None:
        second = int(now)
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append((second, {}))
            while self.buckets and self.buckets[0][0] <= second - RECENT_S:
                self.buckets.popleft()
        counts = self.buckets[-1][1]
        counts[where] = counts.get(where, 0) + 1

    def totals(self, now: float) -> dict[str, int]:
        out = {"remote": 0, "local": 0, "p_alone": 0}
        for second, counts in self.buckets:
            if second > int(now) - RECENT_S:
                for k, v in counts.items():
                    out[k] = out.get(k, 0) + v
        return out
