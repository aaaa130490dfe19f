"""The one seam around Mooncake's TransferEngine (seeds steps 1, 3, 5, 29).

Everything the connector asks of Mooncake goes through ``MooncakeTransport``: start the engine,
register KV memory, write descriptor batches to a peer, probe a peer. Mooncake answers with bare
return codes (details go to its own stderr log), so each failure becomes a ``TransferError``
saying which call, which peer and what usually causes it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.connector.planning.descriptors import MAX_BATCH_DESCS, Descriptors, split_batches
from appliance.netaddr import host_port

PROTOCOLS = ("tcp", "rdma")

_RDMA_REGISTER_HINT = (
    "with rdma on GPU memory, 'Bad address' in Mooncake's log means GPUDirect RDMA is missing: "
    "load nvidia_peermem (modprobe nvidia_peermem) or use a DMA-BUF capable driver/NIC"
)


class TransferError(RuntimeError):
    """A Mooncake call failed; the message names the call, the peer and a likely cause."""


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


def _check_rdma_devices(device_name: str, sys_root: Path) -> None:
    ib = sys_root / "class" / "infiniband"
    present = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    wanted = [d.strip() for d in device_name.split(",") if d.strip()]
    missing = [d for d in wanted if d not in present]
    if not present or missing:
        raise TransferError(
            f"rdma needs RDMA devices: {', '.join(missing or ['any'])} not found in {ib} "
            f"(present: {', '.join(present) or 'none'}); use protocol tcp, or check the NIC "
            "driver and the container's /sys/class/infiniband and /dev/infiniband"
        )


class MooncakeTransport:
    """One TransferEngine per worker process: ``start``, ``register``, then ``write``.

    ``write`` may be called from several threads at once (a sender pool): writes to one peer
    are serialised, because Mooncake's per-peer TCP queue limit (about 2,048 descriptors) counts
    every batch in flight to that peer, and concurrent batches over it all fail together.
    Writes to different peers run in parallel (Mooncake releases the GIL while it waits).
    """

    def __init__(self) -> None:
        self._engine: Any = None
        self._host = ""
        self._protocol = ""
        self._rpc_port = 0
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._peer_locks: dict[str, threading.Lock] = {}

    def start(
        self, host: str, protocol: str = "tcp", device_name: str = "", sys_root: str = "/sys"
    ) -> str:
        """Initialise the engine in P2P-handshake mode; returns the session id peers write to.

        ``host`` must be an address peers can reach: Mooncake accepts any string here and only
        peers' writes would fail. For rdma the devices are checked under ``sys_root`` first,
        because Mooncake starts (and "registers" memory) without any RDMA device present.
        """
        if self._engine is not None:
            raise TransferError("transport already started")
        if protocol not in PROTOCOLS:
            raise TransferError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if protocol == "rdma":
            _check_rdma_devices(device_name, Path(sys_root))
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake logs INFO lines per call
        from mooncake.engine import TransferEngine  # lazy: the import loads native libraries

        engine = TransferEngine()
        ret = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if ret != 0:
            hint = (
                f"is {device_name!r} an RDMA device here (ibv_devices)?"
                if protocol == "rdma"
                else f"is {host!r} an address of this host?"
            )
            raise TransferError(
                f"Mooncake initialize({host!r}, {protocol!r}) returned {ret}: {hint}"
            )
        self._engine = engine
        self._host, self._protocol = host, protocol
        self._rpc_port = int(engine.get_rpc_port())
        return self.session_id

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def rpc_port(self) -> int:
        return self._rpc_port

    @property
    def session_id(self) -> str:
        """``host:rpc_port``, the name peers pass to ``write`` (bracketed for IPv6)."""
        if self._engine is None:
            raise TransferError("transport not started")
        return host_port(self._host, self._rpc_port)

    @property
    def registered(self) -> list[tuple[int, int]]:
        return list(self._registered)

    def _require_engine(self) -> Any:
        if self._engine is None:
            raise TransferError("transport not started")
        return self._engine

    def register(self, spans: Iterable[tuple[int, int]]) -> None:
        """Register memory spans (use ``plan.registration_spans`` to merge views first).

        Over TCP the destination must register its memory too: writes into memory the peer has
        not registered fail.
        """
        spans = list(spans)
        if not spans:
            return
        engine = self._require_engine()
        with self._lock:
            ret = engine.batch_register_memory([a for a, _ in spans], [n for _, n in spans])
            if ret != 0:
                total = sum(n for _, n in spans)
                hint = _RDMA_REGISTER_HINT if self._protocol == "rdma" else "see Mooncake's log"
                raise TransferError(
                    f"Mooncake batch_register_memory of {len(spans)} spans ({total} B) "
                    f"returned {ret}: {hint}"
                )
            self._registered.extend(spans)

    def unregister_all(self) -> None:
        if self._engine is None:
            return
        with self._lock:
            if self._registered:
                ret = self._engine.batch_unregister_memory([a for a, _ in self._registered])
                self._registered.clear()
                if ret != 0:
                    raise TransferError(f"Mooncake batch_unregister_memory returned {ret}")

    def write(
        self,
        session: str,
        descs: Descriptors,
        max_batch: int = MAX_BATCH_DESCS,
        stop: Callable[[], str | None] | None = None,
    ) -> WriteResult:
        """Write every descriptor to ``session``, in batches the peer's queue accepts.

        Seeds step 29. ``stop`` is asked before each batch (the first included, which may
        come long after the caller decided to write: a GPU fence, a busy peer lock); a reason
        it returns ends the write there with ``WriteStopped``, so no batch starts after the
        destination may have given its memory back. On failure the destination may be partly
        written (earlier batches, or part of the failed one): the caller must treat the whole
        request as failed.
        """
        engine = self._require_engine()
        batches = split_batches(descs, max_batch)
        with self._lock:
            peer_lock = self._peer_locks.setdefault(session, threading.Lock())
        with peer_lock:  # seconds count the transfer, not the wait for the peer
            start = time.perf_counter()
            for i, batch in enumerate(batches):
                why = stop() if stop is not None else None
                if why:
                    raise WriteStopped(
                        f"write to {session} stopped before batch {i + 1}/{len(batches)}: {why}"
                    )
                ret = engine.batch_transfer_sync_write(
                    session, batch.srcs, batch.dsts, batch.lengths
                )
                if ret != 0:
                    raise TransferError(
                        f"Mooncake write to {session} failed (ret {ret}) in batch {i + 1}/"
                        f"{len(batches)} of {len(batch)} descriptors, {batch.total_bytes} B: "
                        "peer down or unreachable, or a destination outside its registered memory"
                    )
            seconds = time.perf_counter() - start
        return WriteResult(descs.total_bytes, len(descs), len(batches), seconds)

    def probe(self, session: str) -> bool:
        """Whether the peer's Mooncake RPC answers (0 alive, non-zero dead or unreachable)."""
        return self._require_engine().send_probe(session) == 0

    def close(self) -> None:
        """Unregister memory and drop the engine (Mooncake stops it in its destructor)."""
        try:
            self.unregister_all()
        finally:
            self._engine = None
