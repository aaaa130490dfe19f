"""Releasing KV that P computed for a transfer no decode node will pull.

P keeps a finished prefill's blocks until a D pulls them or `send_timeout_s` passes
(docs/protocol.md step 23; 480 s in the reference). D's connector releases them itself when
D's scheduler saw the request. When D never did (D refused the request before its engine,
was unreachable, or the client left while D's request was still being admitted), or the
proxy gave up on D, only the proxy knows nobody will come: it sends P's workers the
connector's own release, a `CancelRequest` on the side channel, exactly what D's connector
sends. A release is harmless when a pull did happen: P answers for a transfer already over,
and one being written finishes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from appliance.proxy.metrics import ProxyMetrics
from appliance.proxy.ownership.kv import PrefillKV
from appliance.sidechannel import messages as m
from appliance.sidechannel.curve import (
    HANDSHAKE_FAILED,
    CurveKey,
    handshake_failure,
    set_client,
)

log = logging.getLogger("appliance.proxy.ownership.release")

_SEND_TIMEOUT_S = 2.0
_MAX_SOCKETS = 64  # P workers seen lately; a restarted worker listens on a new port


@dataclass
class _Conn:
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)


class KVReleaser:
    """One DEALER per P worker address, the least recently used closed beyond
    _MAX_SOCKETS; replies are read and dropped. With `curve_key` (the cluster's side-channel
    key) each DEALER is a CURVE client: P's workers refuse releases without it."""

    def __init__(self, metrics: ProxyMetrics, curve_key: CurveKey | None = None) -> None:
        self.metrics = metrics
        self._curve_key = curve_key
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: OrderedDict[str, _Conn] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, kv: PrefillKV) -> None:
        """Fire and forget: the request's handler may be cancelled already."""
        addrs = kv.side_channels
        if not addrs:
            log.warning("transfer=%s: no side channel known for %s dp %d; P frees the KV "
                        "after its send_timeout_s", kv.transfer_id, kv.p.url, kv.rank)
            self.metrics.kv_releases.labels("no_address").inc()
            return
        task = asyncio.ensure_future(self._send(list(addrs), kv.transfer_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, addrs: list[str], transfer_id: str) -> None:
        payload = m.encode_cancel(m.CancelRequest(
            engine_id="proxy", reqs=[m.CancelEntry.release(transfer_id)]))
        failed = 0
        for addr in addrs:
            try:
                await asyncio.wait_for(self._sock(addr).send(payload), _SEND_TIMEOUT_S)
            except (asyncio.TimeoutError, zmq.ZMQError) as exc:
                failed += 1
                log.warning("transfer=%s: release to %s not sent: %r", transfer_id, addr, exc)
        self.metrics.kv_releases.labels("failed" if failed else "sent").inc()
        if not failed:
            log.info("transfer=%s: released P's KV at %s", transfer_id, ", ".join(addrs))

    def _sock(self, addr: str) -> zmq.asyncio.Socket:
        conn = self._socks.get(addr)
        if conn is not None:
            self._socks.move_to_end(addr)
            return conn.sock
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve_key is not None:
            set_client(sock, self._curve_key)
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        sock.connect(addr)
        conn = self._socks[addr] = _Conn(sock, monitor)
        conn.tasks = [asyncio.ensure_future(self._drain(addr, sock)),
                      asyncio.ensure_future(self._watch(addr, conn))]
        while len(self._socks) > _MAX_SOCKETS:
            self._socks.popitem(last=False)[1].close()
        return sock

    async def _watch(self, addr: str, conn: _Conn) -> None:
        """P's worker refused our handshake: none of our releases reach it (P frees that KV
        after its send_timeout_s); say so once, count it, and connect afresh next time."""
        why = await handshake_failure(conn.monitor)
        self.metrics.kv_releases.labels("refused").inc()
        log.error("P's side channel %s refused the proxy: %s; check side_channel_key_file is "
                  "the node's; P frees unreleased KV after its send_timeout_s", addr, why)
        if self._socks.get(addr) is conn:
            del self._socks[addr]
        conn.close()

    @staticmethod
    async def _drain(addr: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            payload = await sock.recv()
            try:
                resp = m.decode_response(payload)
            except m.MessageError:
                continue
            log.debug("release answered by %s: %s", addr, resp)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for conn in self._socks.values():
            conn.close()
        self._socks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
