"""The proxy's subscriptions to every P's and D's KV events (vLLM's ZMQ publisher).

Each engine runs with `--kv-events-config` endpoints `tcp://*:0`: vLLM binds them on its
node address (VLLM_HOST_IP) at ports it picks, never on every interface, and lists them at
GET /kv_event_sources (per data-parallel rank). Every `resync_s` this module reads that
list from each node; a node whose list changed (its engine restarted: new ports) has its
entries dropped and is subscribed again. A subscription first replays the publisher's
buffer from sequence 0 (what the engine stored before the proxy listened), then follows the
live stream; a gap in sequence numbers is filled from the replay socket, and what replay
cannot bring back drops that engine's entries (the index then under-predicts, never
over-predicts). With the cluster's key (`side_channel_key_file`) both sockets are CURVE
clients: the engines publish under it (appliance.connector.kvevents).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from appliance.proxy.prefix.index import PrefixIndex, Source, seq_step
from appliance.proxy.prefix.wire import DECODER
from appliance.sidechannel.curve import CurveKey, set_client

log = logging.getLogger("appliance.proxy.prefix")

END_SEQ = -1
REPLAY_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Endpoints:
    events: str
    replay: str | None


def parse_sources(raw: object) -> dict[int, Endpoints]:
    """GET /kv_event_sources: {rank: KVEventsConfig}; ranks without events left out."""
    out: dict[int, Endpoints] = {}
    if not isinstance(raw, dict):
        return out
    for rank, cfg in raw.items():
        if (isinstance(cfg, dict) and cfg.get("enable_kv_cache_events")
                and cfg.get("publisher") == "zmq" and isinstance(cfg.get("endpoint"), str)
                and str(rank).isdigit()):
            replay = cfg.get("replay_endpoint")
            out[int(rank)] = Endpoints(cfg["endpoint"], replay if isinstance(replay, str)
                                       else None)
    return out


class KVEvents:
    def __init__(self, index: PrefixIndex, nodes: Callable[[], Iterable[str]],
                 session: aiohttp.ClientSession, headers: dict[str, str],
                 resync_s: float = 5.0, timeout_s: float = 2.0,
                 key: CurveKey | None = None) -> None:
        self.index = index
        # The cluster's key: the engines publish under it (appliance.connector.kvevents).
        self.key = key
        self.nodes = nodes  # the URLs of every P and D known now
        self.session = session
        self.headers = headers
        self.resync_s = resync_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ctx = zmq.asyncio.Context()
        self.undecodable = 0
        self._sources: dict[str, dict[int, Endpoints]] = {}
        self._streams: dict[str, list[asyncio.Task[None]]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="proxy-kv-events")

    async def stop(self) -> None:
        tasks = [t for ts in self._streams.values() for t in ts]
        if self._task is not None:
            tasks.append(self._task)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._streams.clear()
        self.ctx.term()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the loop must outlive any one round
                log.exception("prefix index: reading the nodes' event sources failed")
            await asyncio.sleep(self.resync_s)

    async def refresh(self) -> None:
        """Each node's sources read once; subscriptions follow what changed."""
        urls = list(self.nodes())
        for url in [u for u in self._sources if u not in urls]:
            self._unsubscribe(url)
            self.index.remove(url)
            del self._sources[url]
        answers = await asyncio.gather(*(self._read(url) for url in urls))
        for url, sources in zip(urls, answers, strict=True):
            if sources is None or sources == self._sources.get(url):
                continue  # unreachable (health checks deal with it) or unchanged
            if url in self._sources:
                log.info("prefix index: %s publishes events elsewhere now (engine "
                         "restarted?)", url)
                self._unsubscribe(url)
                self.index.drop(url, "its event sources changed")
            self._sources[url] = sources
            self._streams[url] = [
                asyncio.create_task(self._follow(self.index.source(url, rank), ep),
                                    name=f"proxy-kv-events-{rank}")
                for rank, ep in sources.items()]

    async def _read(self, url: str) -> dict[int, Endpoints] | None:
        try:
            async with self.session.get(f"{url}/kv_event_sources", headers=self.headers,
                                        timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None if resp.status >= 500 else {}
                return parse_sources(await resp.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    def _unsubscribe(self, url: str) -> None:
        for t in self._streams.pop(url, []):
            t.cancel()

    async def _follow(self, src: Source, ep: Endpoints) -> None:
        """One engine rank's events, for as long as its sources stay: a failure drops what
        it held (nothing heard since may have been evicted) and subscribes again."""
        while True:
            try:
                await self._subscribed(src, ep)
            except (zmq.ZMQError, OSError) as exc:
                log.warning("prefix index: %s rank %d: events failed (%s); subscribing "
                            "again", src.node, src.rank, exc)
                self.index.drop(src.node, "its event stream failed", src.rank)
                await asyncio.sleep(self.resync_s)

    async def _subscribed(self, src: Source, ep: Endpoints) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        if self.key is not None:
            set_client(sub, self.key)
        sub.connect(ep.events)
        try:
            # Subscribed first, so nothing published during the replay is missed.
            await self._replay(src, ep, 0)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                step = seq_step(src.seq, seq)
                if step == "gap":
                    await self._replay(src, ep, src.seq + 1)
                    step = seq_step(src.seq, seq)
                    if step == "gap":
                        self.index.drop(src.node, f"events {src.seq + 1}..{seq - 1} lost",
                                        src.rank)
                elif step == "restart":
                    self.index.drop(src.node, "its engine restarted", src.rank)
                if step != "old":
                    self._apply(src, seq, frames[2])
        finally:
            sub.close()

    async def _replay(self, src: Source, ep: Endpoints, start: int) -> None:
        """Batches from `start` on, from the publisher's buffer, applied in order."""
        if ep.replay is None:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.key is not None:
            set_client(sock, self.key)
        sock.connect(ep.replay)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_WAIT_S * 1000):
                    log.info("prefix index: %s rank %d: no replay answer", src.node, src.rank)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                # The first batch of a fresh source starts it wherever the buffer begins.
                if src.seq < 0 or seq_step(src.seq, seq) == "next":
                    self._apply(src, seq, frames[3])
        finally:
            sock.close()

    def _apply(self, src: Source, seq: int, payload: bytes) -> None:
        try:
            batch = DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            self.undecodable += 1
            log.warning("prefix index: %s rank %d: undecodable batch %d: %s", src.node,
                        src.rank, seq, exc)
            src.seq = seq
            return
        self.index.apply(src, seq, batch.events)
