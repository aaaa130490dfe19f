"""A transport that delays or fails writes by a fault plan, then hands them to the real one
(Mooncake's in a vLLM server, the in-memory fake in unit tests)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterable

from appliance.connector.planning.descriptors import MAX_BATCH_DESCS, Descriptors
from appliance.connector.transfers.transport import TransferError, Transport, WriteResult
from tests.faults.plan import Faults


class FaultyTransport:
    def __init__(self, inner: Transport, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        # What a corrupted write puts over 8 bytes of D's memory: registered with ours, so
        # the real transport carries it as it carries the KV.
        self._junk = (ctypes.c_uint8 * 8)(*([0xA5] * 8))

    @property
    def transport(self) -> str:
        return self.inner.transport

    @property
    def rpc_port(self) -> int:
        return self.inner.rpc_port

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def start(self, host: str, protocol: str = "tcp", device_name: str = "") -> str:
        return self.inner.start(host, protocol, device_name)

    def register(self, spans: Iterable[tuple[int, int]]) -> None:
        self.inner.register([*spans, (ctypes.addressof(self._junk), 8)])

    def write(self, session: str, descs: Descriptors, max_batch: int = MAX_BATCH_DESCS,
              stop: Callable[[], str | None] | None = None) -> WriteResult:
        """On a push thread: the plan's delay, then maybe its failure, else the write."""
        if self.faults.plan.write_delay_ms:
            time.sleep(self.faults.plan.write_delay_ms / 1000)
        if self.faults.fail_write():
            raise TransferError("injected fault: the write failed")
        result = self.inner.write(session, descs, max_batch, stop)
        if len(descs) and self.faults.corrupt_write():
            junk = Descriptors([ctypes.addressof(self._junk)], [descs.dsts[0]], [8])
            self.inner.write(session, junk, max_batch)
        return result

    def close(self) -> None:
        self.inner.close()
