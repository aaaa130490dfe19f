"""D's side-channel sockets: one ZMQ DEALER per producer worker, opened on first contact.

A producer worker binds a random port each time it starts, so every restart leaves D an
address nobody listens on. Each socket's monitor says when its link is up, gone or refused:
- gone (the worker died, or the network dropped it): the receiver forgets the worker's
  cached address, so the next pull asks the sidecar where the worker is now instead of
  queueing for a dead one; with no pull waiting on it, the socket is closed at once;
- refused (a CURVE key not the cluster's): the receiver fails what waits on it.
Sockets idle for `peer_idle_s`, and past `max_peers` the least recently used ones, close
too (never one a pull waits on): a long-lived D talking to many P generations keeps a
bounded set. `vllm:pd_side_channel_peers_opened` / `_closed` count them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from appliance.connector.stats import TransferStats
from appliance.sidechannel import curve
from appliance.sidechannel import messages as m

log = logging.getLogger("vllm.appliance.connector.sidechannel.peers")


class PeerOwner(Protocol):
    def on_response(self, peer: Peer, resp: m.TransferResponse) -> None: ...
    def on_peer_refused(self, peer: Peer, why: str) -> None: ...
    def on_peer_lost(self, peer: Peer) -> None: ...


class Peer:
    """One DEALER socket to one producer worker, with loops for its replies and its
    monitor's events."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, owner: PeerOwner,
                 key: curve.CurveKey | None = None) -> None:
        self.addr = addr
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if key is not None:
            curve.set_client(self.sock, key)
        # With or without a key: a producer that refuses our handshake (keys differ after a
        # rotation not done everywhere, one side without CURVE) fails our pulls at once
        # instead of at recv_timeout_s.
        self._monitor = self.sock.get_monitor_socket(curve.PEER_EVENTS)
        self.sock.connect(addr)
        self.layout_sent = False
        self.up = False  # the link is up (handshake done) right now
        self.lost = False  # it was up, and dropped since
        self.last_used = time.monotonic()
        self.task = asyncio.create_task(self._replies(owner))
        self.watch = asyncio.create_task(self._events(owner))

    async def _events(self, owner: PeerOwner) -> None:
        while True:
            kind, why = await curve.peer_event(self._monitor)
            if kind == "refused":
                owner.on_peer_refused(self, why)
                return
            if kind == "up":
                self.up, self.lost = True, False
            elif self.up:  # "down" after being up; a failed connect attempt is not news
                self.up, self.lost = False, True
                owner.on_peer_lost(self)
                if self.sock.closed:  # the owner closed it (this task's cancel is pending)
                    return

    async def _replies(self, owner: PeerOwner) -> None:
        while True:
            payload = await self.sock.recv()
            self.last_used = time.monotonic()
            try:
                resp = m.decode_response(payload)
            except m.MessageError as exc:
                log.warning("undecodable reply from %s: %s", self.addr, exc)
                continue
            owner.on_response(self, resp)

    async def send(self, payload: bytes) -> None:
        self.last_used = time.monotonic()
        await self.sock.send(payload)

    def close(self) -> None:
        self.task.cancel()
        self.watch.cancel()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.sock.close(0)  # what is still queued for the producer is dropped with it


@dataclass(frozen=True)
class PeerView:
    addr: str
    last_used: float
    lost: bool = False


def to_close(peers: Iterable[PeerView], busy: set[str], now: float, idle_s: float,
             cap: int) -> list[str]:
    """The sockets to close: those whose link was lost or idle past idle_s, then, while
    more than `cap` would be left, the least recently used; never one in `busy` (a pull
    waits on it)."""
    peers = list(peers)
    free = sorted((p for p in peers if p.addr not in busy), key=lambda p: p.last_used)
    kept = len(peers)
    out = []
    for p in free:
        if p.lost or now - p.last_used > idle_s or kept > cap:
            out.append(p.addr)
            kept -= 1
    return out


class Peers:
    """The open sockets by address."""

    def __init__(self, ctx: zmq.asyncio.Context, owner: PeerOwner, stats: TransferStats,
                 key: curve.CurveKey | None, idle_s: float, cap: int) -> None:
        self._ctx, self._owner, self._stats, self._key = ctx, owner, stats, key
        self.idle_s, self.cap = idle_s, cap
        self._open: dict[str, Peer] = {}
        # Addresses whose link dropped and whose socket is closed since: a sidecar may name
        # them until the restarted worker registers anew (bounded: the latest cap).
        self._gone: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def get(self, addr: str) -> Peer:
        peer = self._open.get(addr)
        if peer is None:
            peer = self._open[addr] = Peer(self._ctx, addr, self._owner, self._key)
            self._stats.record_peer(opened=True)
        return peer

    def gone(self, addr: str) -> bool:
        """The link to `addr` dropped (its worker died or restarted elsewhere) and has not
        come back up."""
        peer = self._open.get(addr)
        if peer is not None and peer.up:
            self._gone.pop(addr, None)
            return False
        return (peer is not None and peer.lost) or addr in self._gone

    def close(self, peer: Peer, why: str) -> None:
        if self._open.get(peer.addr) is not peer:
            return  # closed already
        if peer.lost:
            self._gone[peer.addr] = None
            while len(self._gone) > self.cap:
                self._gone.popitem(last=False)
        del self._open[peer.addr]
        peer.close()
        self._stats.record_peer(opened=False)
        log.info("side channel to %s closed: %s", peer.addr, why)

    def sweep(self, busy: set[str], now: float) -> list[str]:
        """Closes what `to_close` picks; returns their addresses. The caller forgets them
        as workers' addresses: once D closed the socket no link event comes, and a worker
        restarted meanwhile (same engine id, new port) must be looked up again."""
        views = [PeerView(p.addr, p.last_used, p.lost) for p in self._open.values()]
        closed = to_close(views, busy, now, self.idle_s, self.cap)
        for addr in closed:
            peer = self._open[addr]
            idle = now - peer.last_used
            self.close(peer, "the producer went away" if peer.lost else
                       f"idle for {idle:.0f} s" if idle > self.idle_s else
                       f"least recently used of more than max_peers={self.cap}")
        return closed

    def close_all(self) -> None:
        for peer in list(self._open.values()):
            peer.close()
        self._open.clear()
