"""How long each part of one split request waits, derived from one setting: how long the
proxy waits for P's answer (`prefill_s`: P's queue and its prefill).

A decode node asked together with P must wait longer than the proxy does, or it gives up
and recomputes a prompt P is still computing (the prompt computed twice, P's work thrown
away, and overload on P spreading to D). So D's receive deadline is `prefill_s +
transfer_s`, and the proxy sends it with each request (`recv_timeout_ms` in D's
`kv_transfer_params`): what D was configured with is only the default for callers that
send none. D tells P its deadline (docs/protocol.md step 21); P starts no write after that deadline
less a margin (a write must end before D gives up, not merely start), and waits for a
prefill D asked about as long as D waits. The margin is at most WRITE_MARGIN_MAX_S, and
`transfer_s` is at least that, so a P that answered within `prefill_s` always writes.

When the proxy stops waiting for P it closes P's call (vLLM aborts the request: a prompt
still queued on P is never computed) and D's (D frees its blocks), then asks D alone: the
prompt is computed once, on D. `auto` placement does that before asking when P's backlog
alone would outlast `prefill_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

# P's margin before D's deadline: this share of the deadline, at most WRITE_MARGIN_MAX_S.
WRITE_MARGIN_SHARE = 0.2
WRITE_MARGIN_MAX_S = 5.0
# D's wait beyond the proxy's, for the write itself (ample for a long prompt's KV over TCP).
DEFAULT_TRANSFER_S = 10.0
DEFAULT_PREFILL_S = 120.0
# The most a request may ask D to wait (a day): larger values are refused as nonsense.
MAX_RECV_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class Deadlines:
    prefill_s: float = DEFAULT_PREFILL_S
    transfer_s: float = DEFAULT_TRANSFER_S

    @property
    def recv_s(self) -> float:
        """D's receive deadline for a request asked together with P."""
        return self.prefill_s + self.transfer_s

    @property
    def send_s(self) -> float:
        """P's hold of computed KV that no decode node asked for."""
        return self.recv_s + self.transfer_s

    def recv_ms(self, after_prefill: bool = False) -> int:
        """What the proxy sends D: a request asked once P answered (its KV computed
        already) waits for the write alone."""
        return round(1000 * (self.transfer_s if after_prefill else self.recv_s))


def write_by_s(deadline_s: float) -> float:
    """Seconds from D's message after which P starts no write for it."""
    return deadline_s - min(WRITE_MARGIN_SHARE * deadline_s, WRITE_MARGIN_MAX_S)
