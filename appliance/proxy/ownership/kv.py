"""Who must free the KV that P computes for one request's transfer: one explicit state.

P keeps a finished prefill's blocks until a D pulls them or its `send_timeout_s` passes
(docs/protocol.md step 23). While the proxy has not seen D answer a request that asks for them, only
the proxy knows whether anyone will come, so until then the KV is the proxy's to release
(appliance.proxy.ownership.release); once D answered, D's connector pulls or frees it.
Every change of holder goes through PrefillKV.move(), which refuses the impossible ones
and logs each with the transfer id.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from appliance.proxy.nodes.backends import PrefillBackend
from appliance.proxy.upstream.response import Response

log = logging.getLogger("appliance.proxy.kv")

# D's call failed over because the P it waits on went down (appliance.proxy.exchange.relay
# retries it on D alone).
PREFILL_DOWN = "prefill_down"


class Holder(enum.Enum):
    PROXY = "proxy"  # P may hold KV and no D request asks for it: the proxy must release it
    ASKED = "asked"  # a D request asking for it is in flight: still the proxy's
    DECODE = "decode"  # D answered that request: D's connector pulls or frees it
    NONE = "none"  # P holds none: it refused, was never reached, or its token ended it


_ALLOWED: dict[Holder, frozenset[Holder]] = {
    Holder.PROXY: frozenset({Holder.ASKED, Holder.NONE}),
    # back to PROXY: the D request was given up (D asked alone instead)
    Holder.ASKED: frozenset({Holder.DECODE, Holder.PROXY, Holder.NONE}),
    Holder.DECODE: frozenset(),
    Holder.NONE: frozenset(),
}


class OwnershipError(RuntimeError):
    """A change of holder that cannot happen (a bug in the exchange)."""


@dataclass(slots=True, eq=False)  # compared and hashed by identity (Pulls keeps a set)
class PrefillKV:
    """The KV one request's P leg may hold, and who is responsible for it now."""

    p: PrefillBackend
    rank: int
    transfer_id: str
    holder: Holder = Holder.PROXY
    # D's call, once it waits only on P's KV (P answered); failed over if P goes down.
    d_call: Response | None = None
    # The side channels of the P workers asked, as known then: a release goes to them even
    # when P has since gone out of rotation (a frozen P reads it once it runs again).
    side_channels: tuple[str, ...] = ()
    # The D asked to pull, and the prompt's full blocks it lacked then (the prefix index's
    # hashes; empty: unknown). Once D's own KV events say it caches them all, its pull is
    # done: P's failure then costs that D call nothing (Pulls.fail_over).
    d_url: str = ""
    lands: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.side_channels:
            self.side_channels = tuple(self.p.side_channels.get(self.rank, ()))

    def move(self, to: Holder, why: str) -> None:
        """The one place the holder changes."""
        if to is self.holder:
            return
        if to not in _ALLOWED[self.holder]:
            raise OwnershipError(f"transfer={self.transfer_id}: KV cannot go from "
                                 f"{self.holder.value} to {to.value} ({why})")
        log.debug("transfer=%s: KV %s -> %s: %s", self.transfer_id, self.holder.value,
                  to.value, why)
        self.holder = to
        if to is not Holder.ASKED:
            self.d_call = None

    @property
    def owed(self) -> bool:
        """Nobody else will pull or free it: the proxy must release it."""
        return self.holder in (Holder.PROXY, Holder.ASKED)

    def decode_answered(self) -> None:
        """D's first bytes: its engine has the request, so its connector owns the KV."""
        if self.holder is Holder.ASKED:
            self.move(Holder.DECODE, "D answered")

    def given_up(self, why: str) -> None:
        """The D request that asked for it was abandoned (D is asked alone instead)."""
        if self.holder is Holder.ASKED:
            self.move(Holder.PROXY, why)
