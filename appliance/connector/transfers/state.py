"""One explicit state per transfer, as SGLang's KVPoll: every timeout and error lands here.

    BOOTSTRAPPING ─▶ WAITING_FOR_INPUT ─▶ TRANSFERRING ─▶ SUCCESS
                            └──────▶ VERIFYING (D) ─────────▶ SUCCESS
    any state but SUCCESS ──────────────────────────────────▶ FAILED

Producer: a transfer waits for input until both its prefill is computed and the decode
node's metadata has arrived (docs/protocol.md steps 22, 27), then transfers (28-30).
Consumer: bootstrapping while it resolves the producer's workers (20), waiting for input
once its metadata is sent (21) until the producer answers (34), then, when it checks what
landed (`verify_kv`), verifying while it sums its blocks (digest.py).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

# Under "vllm." so that vLLM's logging configuration formats and shows these lines.
log = logging.getLogger("vllm.appliance.connector")


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    VERIFYING = "verifying"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


_ALLOWED = {
    TransferState.BOOTSTRAPPING: {TransferState.WAITING_FOR_INPUT, TransferState.FAILED},
    TransferState.WAITING_FOR_INPUT: {TransferState.TRANSFERRING, TransferState.SUCCESS,
                                      TransferState.VERIFYING, TransferState.FAILED},
    TransferState.VERIFYING: {TransferState.SUCCESS, TransferState.FAILED},
    TransferState.TRANSFERRING: {TransferState.SUCCESS, TransferState.FAILED},
    TransferState.SUCCESS: set(),
    TransferState.FAILED: set(),
}


class InvalidTransition(RuntimeError):
    pass


@dataclass
class Transfer:
    """Shared bookkeeping of one transfer on either side."""

    transfer_id: str
    side: str  # "send" or "recv"
    state: TransferState = TransferState.WAITING_FOR_INPUT
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    changed: float = field(default_factory=time.monotonic)

    def advance(self, new: TransferState, error: str | None = None, **ids: object) -> None:
        if new not in _ALLOWED[self.state]:
            raise InvalidTransition(f"{self.side} {self.transfer_id}: {self.state.value} -> "
                                    f"{new.value}")
        self.state, self.changed = new, time.monotonic()
        if error:
            self.error = error
        extra = " ".join(f"{k}={v}" for k, v in ids.items() if v is not None)
        level = logging.WARNING if new is TransferState.FAILED else logging.DEBUG
        log.log(level, "%s %s -> %s %s%s", self.side, self.transfer_id, new.value, extra,
                f" error={error}" if error else "")

    def fail(self, error: str, **ids: object) -> bool:
        """Move to FAILED unless already terminal; returns whether it moved."""
        if self.state.terminal:
            return False
        self.advance(TransferState.FAILED, error, **ids)
        return True
