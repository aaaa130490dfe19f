"""One client request in the proxy, and everything it holds until it ends.

A request takes counts on the proxy and its nodes (the proxy's `in_flight`, its admission
slot on D, the serving node's `decodes`, P's `in_flight` while P computes, P's `transfers`
while P may hold its KV), a placement ticket (its prompt's tokens queued on P or D), an
expectation in the prefix index, and possibly P's KV. Each is taken here, as a lease that
gives itself back once, and `end()` (the request's one `finally`, in appliance.proxy.app)
gives back whatever is still held: nothing is undone anywhere else. The access line's
values live apart, in `rec` (appliance.proxy.access), written as the request goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from appliance.proxy.access import AccessRecord
from appliance.proxy.ownership.kv import Holder, PrefillKV

if TYPE_CHECKING:
    from appliance.proxy.nodes.backends import Backend
    from appliance.proxy.ownership.pulls import Pulls
    from appliance.proxy.ownership.release import KVReleaser
    from appliance.proxy.placement import Decision, Ticket
    from appliance.proxy.prefix.cache import Lookup, PrefixCache

log = logging.getLogger("appliance.proxy")


class Trace(Protocol):
    """A request's spans (appliance.proxy.tracing: sampled or not): each upstream call puts
    its context into the call's headers, and the request's end closes it."""

    def call(self, role: str, url: str, rec: AccessRecord, headers: dict[str, str]) -> None: ...

    def finish(self, rec: AccessRecord) -> None: ...


@dataclass(slots=True, eq=False)
class Lease:
    """One count taken on `owner.<counter>` for as long as the request needs it; `then`
    runs once it is given back (the admission queue's next waiter)."""

    owner: Any
    counter: str
    then: Callable[[], None] | None = None
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            setattr(self.owner, self.counter, getattr(self.owner, self.counter) - 1)
            if self.then is not None:
                self.then()


def take(owner: Any, counter: str, then: Callable[[], None] | None = None) -> Lease:
    setattr(owner, counter, getattr(owner, counter) + 1)
    return Lease(owner, counter, then)


class Flight:
    """A request's accounts: its leases, its ticket, its prefix expectation, P's KV."""

    def __init__(self, rec: AccessRecord, trace: Trace | None, pulls: Pulls,
                 releaser: KVReleaser, prefix_cache: PrefixCache | None) -> None:
        self.rec = rec
        self.trace = trace
        self._pulls = pulls
        self._releaser = releaser
        self._prefix_cache = prefix_cache
        self._leases: list[Lease] = []
        # The node decoding the request, and its leases (`decodes`; `in_flight` when it is
        # P, whose drains, leaves and routing must see it).
        self._serving: Backend | None = None
        self._serving_leases: list[Lease] = []
        self.ticket: Ticket | None = None
        self.prefix: Lookup | None = None  # each node's cached share of the prompt
        self._expected_on: str | None = None  # where the index expects its blocks
        self.kv: PrefillKV | None = None  # set once P is asked to keep KV for a transfer

    # ---- leases ------------------------------------------------------------------------

    def hold(self, owner: Any, counter: str, then: Callable[[], None] | None = None) -> Lease:
        """Counts the request in `owner.<counter>` until released or the request ends."""
        lease = take(owner, counter, then)
        self._leases.append(lease)
        return lease

    def serve_on(self, node: Backend, holds_node: bool) -> None:
        """`node` decodes the request (counted in its `decodes`; in its `in_flight` too when
        the admission slot is not its own: P serving it whole, another D after a failure)."""
        self._serving = node
        self._serving_leases.append(self.hold(node, "decodes"))
        if holds_node:
            self._serving_leases.append(self.hold(node, "in_flight"))
        self.rec.batch = node.decodes

    def stop_serving(self) -> None:
        """The serving node's counts given back (its answer is over, or it went down); the
        request's batch is the mean of the requests that node held at start and now."""
        if self._serving is not None and self.rec.batch is not None:
            self.rec.batch = (self.rec.batch + self._serving.decodes) / 2
        self._serving = None
        for lease in self._serving_leases:
            lease.release()
        self._serving_leases.clear()

    # ---- placement ---------------------------------------------------------------------

    def looked_up(self, lookup: Lookup | None) -> None:
        self.prefix = lookup
        if lookup is not None:
            self.rec.looked_up, self.rec.tokenize_s = lookup.tokens, lookup.tokenize_s

    def placed(self, decision: Decision, ticket: Ticket, prompt_chars: int) -> None:
        self.rec.placed, self.ticket, self.rec.prompt_chars = decision, ticket, prompt_chars

    def expect(self, node_url: str) -> None:
        """Its blocks are cached where it is computed from the step it is scheduled in: a
        burst on the same prefix goes there before the events say so."""
        if self._prefix_cache is not None and self.prefix is not None:
            self._expected_on = node_url
            self._prefix_cache.expect(node_url, self.prefix)

    def close_ticket(self, now: float, learn: bool, tokens: int | None = None) -> None:
        """The one place the prefill's ticket closes: its tokens leave its node's queue."""
        if self.ticket is not None:
            self.ticket.close(now, learn=learn, tokens=tokens)

    def prefill_answered(self, now: float, ok: bool, prompt_tokens: int | None) -> None:
        """P answered (its KV is ready for D): its prefill leaves P's queue."""
        self.rec.prefilled_at = now
        self.rec.prompt_tokens = prompt_tokens
        self.close_ticket(now, learn=ok, tokens=prompt_tokens)

    # ---- P's KV ------------------------------------------------------------------------

    def take_kv(self, kv: PrefillKV) -> PrefillKV:
        """P will hold KV for this request: P stays known (its `transfers`) till the end."""
        self.kv = kv
        self.hold(kv.p, "transfers")
        return kv

    # ---- the end -----------------------------------------------------------------------

    def end(self) -> None:
        """However the request ended: every count given back, the ticket closed, the index's
        expectation withdrawn, and P's KV released if no D took it over."""
        self.stop_serving()
        for lease in reversed(self._leases):
            lease.release()
        self.close_ticket(time.monotonic(), learn=False)
        if self._expected_on is not None and self._prefix_cache is not None:
            assert self.prefix is not None
            self._prefix_cache.unexpect(self._expected_on, self.prefix)
            self._expected_on = None
        kv = self.kv
        if kv is not None:
            self._pulls.done(kv)
            if kv.owed:
                # No D took P's KV over: free it now rather than after P's send_timeout_s.
                self._releaser.release(kv)
                kv.move(Holder.NONE, "released by the proxy")
