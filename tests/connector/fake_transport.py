"""An in-memory ``Transport`` (appliance.connector.transfers.transport) for connector tests.

Peers are ``FakeTransport``s of one ``FakeNetwork`` in this process; a write really copies
the bytes from our registered memory into the peer's, batch by batch, as Mooncake does
between processes, and checks both ends lie in registered memory as Mooncake does (a write
outside it would corrupt this process, not fail). A test can make writes fail, land slowly
or find their peer lost, which Mooncake over loopback cannot be made to do on demand.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.connector.planning.descriptors import MAX_BATCH_DESCS, Descriptors, split_batches
from appliance.connector.transfers.transport import TransferError, WriteResult, WriteStopped
from appliance.netaddr import host_port


class FakeNetwork:
    """The sessions of one test, by name (``host:port``, as D sends P its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ports = itertools.count(17000)
        self._sessions: dict[str, FakeTransport] = {}

    def join(self, transport: FakeTransport, host: str) -> int:
        with self._lock:
            port = next(self._ports)
            self._sessions[host_port(host, port)] = transport
            return port

    def lose(self, session: str) -> None:
        """The peer at ``session`` is gone (killed, or the link cut): writes to it fail."""
        with self._lock:
            self._sessions.pop(session, None)

    def find(self, session: str) -> FakeTransport | None:
        with self._lock:
            return self._sessions.get(session)


@dataclass
class FakeFaults:
    """What a transport's next writes do wrong; a test may change it while writes run."""

    fail_writes: int = 0  # this many of the next writes fail...
    fail_at_batch: int = 1  # ...in this batch (1: nothing lands; 2: the first batch did)
    batch_delay_s: float = 0.0  # every batch takes this long to land (a slow link)
    corrupt_writes: int = 0  # this many of the next writes land with one byte flipped


class FakeTransport:
    def __init__(self, network: FakeNetwork) -> None:
        self.network = network
        self.faults = FakeFaults()
        self.batch_starts: list[float] = []  # monotonic time each batch began landing
        self._lock = threading.Lock()
        self._host = ""
        self._port = 0
        self._protocol = ""
        self._spans: list[tuple[int, int]] = []

    @property
    def transport(self) -> str:
        return self._protocol

    @property
    def rpc_port(self) -> int:
        return self._port

    @property
    def session_id(self) -> str:
        if not self._port:
            raise TransferError("transport not started")
        return host_port(self._host, self._port)

    def start(self, host: str, protocol: str = "tcp", device_name: str = "") -> str:
        if self._port:
            raise TransferError("transport already started")
        self._host, self._protocol = host, protocol
        self._port = self.network.join(self, host)
        return self.session_id

    def register(self, spans: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def holds(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) lies inside one registered span."""
        with self._lock:
            return any(a <= addr and addr + nbytes <= a + n for a, n in self._spans)

    def write(self, session: str, descs: Descriptors, max_batch: int = MAX_BATCH_DESCS,
              stop: Callable[[], str | None] | None = None) -> WriteResult:
        if not self._port:
            raise TransferError("transport not started")
        batches = split_batches(descs, max_batch)
        with self._lock:
            failing = self.faults.fail_writes > 0
            if failing:
                self.faults.fail_writes -= 1
            corrupting = self.faults.corrupt_writes > 0
            if corrupting:
                self.faults.corrupt_writes -= 1
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            where = f"write to {session}, batch {i + 1}/{len(batches)}"
            why = stop() if stop is not None else None
            if why:  # MooncakeTransport's words, which the connector's tests look for
                raise WriteStopped(f"write to {session} stopped before batch {i + 1}/"
                                   f"{len(batches)}: {why}")
            self.batch_starts.append(time.monotonic())
            time.sleep(self.faults.batch_delay_s)
            if failing and i + 1 >= self.faults.fail_at_batch:
                raise TransferError(f"{where}: failed (injected)")
            self._land(session, batch, where)
        if corrupting and len(descs):  # reported landed, as a bad NIC or a bug would
            flip = ctypes.c_uint8.from_address(descs.dsts[-1] + descs.lengths[-1] // 2)
            flip.value ^= 0x10
        return WriteResult(descs.total_bytes, len(descs), len(batches),
                           time.perf_counter() - start)

    def _land(self, session: str, batch: Descriptors, where: str) -> None:
        peer = self.network.find(session)
        if peer is None:
            raise TransferError(f"{where}: peer down or unreachable")
        for src, dst, n in zip(batch.srcs, batch.dsts, batch.lengths, strict=True):
            if not self.holds(src, n):
                raise TransferError(f"{where}: source {src:#x}+{n} not registered here")
            if not peer.holds(dst, n):
                raise TransferError(f"{where}: destination {dst:#x}+{n} outside the peer's "
                                    "registered memory")
            ctypes.memmove(dst, src, n)

    def close(self) -> None:
        if self._port:
            self.network.lose(self.session_id)
        with self._lock:
            self._spans.clear()
        self._port = 0
        self._protocol = ""
