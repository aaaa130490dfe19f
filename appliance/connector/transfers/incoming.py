"""One pull on the consumer's side (transfers/receiver.py): what D asked of which producer
workers, and what it waits for before it hands the request's blocks back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from appliance.connector.metadata import RecvSpec
from appliance.connector.transfers.state import Transfer


@dataclass
class Incoming(Transfer):
    side: str = "recv"
    d_req_id: str = ""
    spec: RecvSpec | None = None
    deadline: float = 0.0
    # The producer workers asked (side-channel addresses) that have not answered yet: one,
    # or with P's TP larger than ours each one holding some of our heads.
    waiting: set[str] = field(default_factory=set)
    failure: str | None = None  # a producer's failure, once the others have answered
    # Given up on (aborted, or past its deadline) while the producer may be writing into
    # its blocks: they stay held until the producer answers or until hold_until, after
    # which it can write nothing more (see Receiver._give_up).
    cancelled: bool = False
    cancel_reason: str = ""
    hold_until: float = 0.0
    # Checked before vLLM may read its blocks (`verify_kv`): each producer's digest of what
    # it wrote (None: it sent none), summed and compared with ours of what landed.
    verify: bool = False
    digests: list[int | None] = field(default_factory=list)


def remaining_ms(deadline: float) -> int:
    """Milliseconds left until `deadline` (at least 1): what D tells P it will still wait."""
    return max(1, int((deadline - time.monotonic()) * 1000))
