"""One transfer on the producer's side, and the write that moves it (in a push thread).

Everything but `write` is touched only on the side-channel loop; `stop_reason` is the one
thing a push thread reads while a write runs, before each batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.connector.planning.descriptors import Descriptors
from appliance.connector.transfers.state import Transfer
from appliance.connector.transfers.transport import Transport, WriteResult


@dataclass
class Outgoing(Transfer):
    side: str = "send"
    p_req_id: str | None = None
    block_ids: list[list[int]] | None = None  # per KV-cache group
    fence: Callable[[], None] | None = None  # waits until the KV is really computed (GPU)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    d_req_id: str | None = None  # set once a decode node asked for this transfer
    deadline: float = 0.0
    scheduler_finished: bool = False
    preempted: bool = False  # its source blocks were freed while being written
    cancelled: bool = False  # the decode node gave up while it was being written
    write_by: float = float("inf")  # no batch starts later (the decode node's deadline)
    # With D's TP larger than P's, several decode ranks pull heads of one prompt from this
    # worker: the transfer succeeds (and its blocks go back) once each was served.
    legs: int = 1
    asked: set[int] = field(default_factory=set)  # decode ranks that asked
    served: set[int] = field(default_factory=set)  # decode ranks written to (or not needing)
    writing: int = 0  # legs being written now

    @property
    def all_served(self) -> bool:
        return len(self.served) >= self.legs

    def stop_reason(self) -> str | None:
        """Why a write under way must stop before its next batch; asked from a push thread,
        so only flags the loop sets and the clock are read."""
        if self.preempted:
            return "the prefill was preempted while its KV was being written"
        if time.monotonic() > self.write_by:
            return "the decode node's deadline passed"
        if self.cancelled:
            return "cancelled by the decode node"
        return None


def write(transport: Transport, fence: Callable[[], None] | None, session: str,
          descs: Descriptors, max_batch: int,
          stop: Callable[[], str | None] | None = None,
          digest: Callable[[], int | None] | None = None) -> tuple[WriteResult, int | None]:
    """In a push thread: wait for the KV to exist (GPU fence), then write, asking `stop`
    before each batch; then, when D asked for one, the digest of what was written (its
    source blocks are held until the answer, so they still hold those bytes)."""
    if fence is not None:
        fence()
    result = transport.write(session, descs, max_batch, stop)
    return result, digest() if digest is not None else None
