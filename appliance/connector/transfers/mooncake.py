"""The product's KV transport: Mooncake's TransferEngine (docs/protocol.md steps 1, 3, 5, 29).

``MooncakeTransport`` is the connector's ``transport.Transport``, and everything it asks of
Mooncake goes through it: start the engine, register KV memory, write descriptor batches to
a peer, probe a peer. Mooncake answers with bare return codes (details go to its own stderr
log), so each failure becomes a ``TransferError`` saying which call, which peer and what
usually causes it.

Which transport Mooncake installs is not what ``protocol`` says: its engine discovers RDMA
devices itself and installs RDMA whenever one is usable, TCP otherwise, unless ``MC_FORCE_TCP``
exists (any value). So ``tcp`` sets ``MC_FORCE_TCP``, and ``rdma`` checks after start-up that
RDMA is what got installed (``installed_transport``), failing start-up otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from appliance.connector.planning.descriptors import MAX_BATCH_DESCS, Descriptors, split_batches
from appliance.connector.transfers.transport import TransferError, WriteResult, WriteStopped
from appliance.netaddr import host_port

log = logging.getLogger("vllm.appliance.connector.mooncake")

PROTOCOLS = ("tcp", "rdma")
FORCE_TCP = "MC_FORCE_TCP"
_FALSE_WORDS = ("", "0", "false", "no", "off")

_RDMA_REGISTER_HINT = (
    "with rdma on GPU memory, 'Bad address' in Mooncake's log means GPUDirect RDMA is missing: "
    "load nvidia_peermem (modprobe nvidia_peermem) or use a DMA-BUF capable driver/NIC"
)


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


def force_tcp_env(protocol: str, environ: MutableMapping[str, str]) -> None:
    """Make this process's environment say what ``protocol`` says, before the engine exists.

    Mooncake's init only asks whether MC_FORCE_TCP exists (``getenv``, any value, "0" too),
    then skips discovery and installs TCP. tcp: set it unless already there (any value
    already forces). rdma: a false-looking value ("0", "false") meant "do not force", which
    Mooncake would misread, so it is dropped; a true one contradicts rdma and is an error.
    """
    value = environ.get(FORCE_TCP)
    if protocol == "tcp":
        environ.setdefault(FORCE_TCP, "1")
    elif value is not None:
        if value.strip().lower() not in _FALSE_WORDS:
            raise TransferError(
                f"protocol rdma, but {FORCE_TCP}={value!r} is set, which makes Mooncake move "
                f'KV over TCP: unset {FORCE_TCP}, or use protocol "tcp"'
            )
        del environ[FORCE_TCP]
        log.warning("%s=%r removed from this process's environment: Mooncake forces TCP "
                    "whenever the variable exists, whatever its value", FORCE_TCP, value)


def topology_hcas(topology: str) -> list[str]:
    """RDMA devices in Mooncake's topology JSON (``{location: [[preferred], [other]]}``)."""
    try:
        matrix = json.loads(topology or "{}")
    except ValueError:
        return []
    names: set[str] = set()
    for entry in matrix.values() if isinstance(matrix, dict) else ():
        for group in entry if isinstance(entry, list) else ():
            names.update(str(n) for n in (group if isinstance(group, list) else ()))
    return sorted(names)


def installed_transport(environ: Mapping[str, str], hcas: Sequence[str], *,
                        mnnvl: bool = False, intra_nvlink: bool = False) -> str:
    """The transport Mooncake's ``TransferEngineImpl::init`` installs, in its order:
    MC_FORCE_TCP (present) wins; builds with intra-node NVLink take it on
    MC_INTRANODE_NVLINK; MNNVL builds take NVLink on MC_FORCE_MNNVL or when no HCA was found;
    then RDMA when discovery found an HCA (or MC_FORCE_HCA), else TCP."""
    if FORCE_TCP in environ:
        return "tcp"
    if intra_nvlink and "MC_INTRANODE_NVLINK" in environ:
        return "nvlink_intra"
    if mnnvl and ("MC_FORCE_MNNVL" in environ or not hcas):
        return "nvlink"
    return "rdma" if hcas or "MC_FORCE_HCA" in environ else "tcp"


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine  # lazy: the import loads native libraries

    return TransferEngine()


def _probe_transport(engine: Any, device_name: str) -> tuple[str, list[str]]:
    """(installed transport, HCAs) of a started engine. Mooncake has no call naming its
    installed transport; ``get_local_topology(device_name)`` runs the same discovery (same
    filter, same environment) on a throwaway engine, so its HCAs are the ones ours found."""
    if FORCE_TCP in os.environ:  # init returned before discovery: nothing to probe
        return "tcp", []
    hcas = topology_hcas(engine.get_local_topology(device_name))
    build = sys.modules.get("mooncake.engine")
    return installed_transport(os.environ, hcas,
                               mnnvl=bool(getattr(build, "SUPPORT_MNNVL", False)),
                               intra_nvlink=bool(getattr(build, "SUPPORT_INTRA_NVLINK", False))
                               ), hcas


def _not_rdma(transport: str, device_name: str) -> TransferError:
    among = f" among {device_name!r}" if device_name else ""
    if transport == "nvlink_intra" or "MC_FORCE_MNNVL" in os.environ:
        why = "MC_INTRANODE_NVLINK or MC_FORCE_MNNVL is set"
    else:
        why = (f"it found no usable RDMA device{among} (one whose /dev/infiniband node opens "
               "read-write, with an ACTIVE port)")
    return TransferError(
        f"protocol rdma asked, but Mooncake installed {transport}: {why}; check the NIC, "
        f'device_name and the container\'s /dev/infiniband, or use protocol "tcp"'
    )


class MooncakeTransport:
    """One TransferEngine per worker process: ``start``, ``register``, then ``write``
    (a ``transport.Transport``).

    ``write`` may be called from several threads at once (a sender pool): writes to one peer
    are serialised, because Mooncake's per-peer TCP queue limit (about 2,048 descriptors) counts
    every batch in flight to that peer, and concurrent batches over it all fail together.
    Writes to different peers run in parallel (Mooncake releases the GIL while it waits).
    """

    def __init__(self, engine_factory: Callable[[], Any] = _mooncake_engine) -> None:
        self._new_engine = engine_factory  # the seam tests replace
        self._engine: Any = None
        self._host = ""
        self._protocol = ""
        self._transport = ""
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
        because Mooncake starts (and "registers" memory) without any RDMA device present, and
        the transport it installed is checked after (``transport``).
        """
        if self._engine is not None:
            raise TransferError("transport already started")
        if protocol not in PROTOCOLS:
            raise TransferError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        force_tcp_env(protocol, os.environ)
        # Mooncake splits on "," and matches names exactly: " mlx5_1" would name no device.
        device_name = ",".join(d.strip() for d in device_name.split(",") if d.strip())
        if protocol == "rdma":
            _check_rdma_devices(device_name, Path(sys_root))
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake logs INFO lines per call
        engine = self._new_engine()
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
        transport, hcas = _probe_transport(engine, device_name)
        if protocol == "rdma" and transport != "rdma":
            raise _not_rdma(transport, device_name)  # the engine goes with this frame
        if unusable := [d for d in device_name.split(",") if hcas and d and d not in hcas]:
            log.warning("Mooncake skipped %s (not usable: no /dev/infiniband node or no ACTIVE "
                        "port); KV moves over %s only", ",".join(unusable), ",".join(hcas))
        self._engine = engine
        self._host, self._protocol, self._transport = host, protocol, transport
        self._rpc_port = int(engine.get_rpc_port())
        log.info("Mooncake session %s: %s installed (asked %s%s)", self.session_id, transport,
                 protocol, f", HCAs {','.join(hcas)}" if hcas else "")
        return self.session_id

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def transport(self) -> str:
        """The transport Mooncake installed ("tcp" or "rdma"); "" before start."""
        return self._transport

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

        Protocol step 29. ``stop`` is asked before each batch (the first included, which may
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
            self._transport = ""
