"""What the connector needs of a KV transport, whatever moves the bytes.

The worker starts one per process and registers its KV memory; P's push threads write
descriptor batches into a peer's registered memory (``write``); D tells P where to write
(its session, ``host:rpc_port``). ``MooncakeTransport`` (transfers/mooncake.py) is the one
the product runs; tests run the connector over an in-memory one (tests/connector) or a
faulty wrapper (tests/faults). The facade picks it (``PDConnector.new_transport``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from appliance.connector.planning.descriptors import MAX_BATCH_DESCS, Descriptors


class TransferError(RuntimeError):
    """A transport call failed; the message names the call, the peer and a likely cause."""


class WriteStopped(TransferError):
    """A write was stopped between two batches (its deadline passed, or it was cancelled or
    preempted): the batches before it may have landed, none after it will."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    nbytes: int
    descriptors: int
    batches: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Transport(Protocol):
    """One per worker process: ``start``, ``register``, then ``write`` (from several threads
    at once), ``close`` at shutdown. Failures raise ``TransferError``."""

    @property
    def transport(self) -> str:
        """What moves the bytes ("tcp", "rdma"), for /metrics; "" before start."""
        ...

    @property
    def rpc_port(self) -> int:
        """The port of ``session_id``, which D sends P with its host."""
        ...

    @property
    def session_id(self) -> str:
        """``host:rpc_port``: the name peers pass to ``write`` to reach this process."""
        ...

    def start(self, host: str, protocol: str = "tcp", device_name: str = "") -> str:
        """Listen at ``host`` (an address peers reach); returns ``session_id``."""
        ...

    def register(self, spans: Iterable[tuple[int, int]]) -> None:
        """Make these (address, length) spans of this process's memory writable by peers
        and readable by our writes."""
        ...

    def write(self, session: str, descs: Descriptors, max_batch: int = MAX_BATCH_DESCS,
              stop: Callable[[], str | None] | None = None) -> WriteResult:
        """Copy every descriptor (our source, the peer's destination) to ``session``, in
        batches of at most ``max_batch``; returns once all landed. ``stop`` is asked before
        each batch: a reason ends the write with ``WriteStopped``. On any failure the peer
        may be partly written."""
        ...

    def close(self) -> None:
        """Unregister the memory and stop; peers' writes to us fail from now on."""
        ...
