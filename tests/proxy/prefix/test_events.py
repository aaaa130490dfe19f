"""The subscriptions against vLLM's own publisher (vllm.distributed.kv_events, in this
process, on loopback): what was stored before the proxy listened comes by replay, later
batches live; a gap is filled from the replay socket, an unfillable one drops the engine's
entries; a restarted engine (new endpoints) is dropped and followed again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp import web

from appliance.proxy.prefix import hashing
from appliance.proxy.prefix.events import KVEvents, parse_sources
from appliance.proxy.prefix.index import PrefixIndex
from tests.proxy.conftest import until

SIZE = 4
PROMPT = list(range(200, 216))


def _ext(ids: list[int]) -> list[int]:
    return [hashing.external(h) for h in hashing.chain(ids, SIZE)]


def _batch(ids: list[int], skip: int = 0):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    hashes = _ext(ids)
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes[skip:], parent_block_hash=hashes[skip - 1] if skip else None,
        token_ids=ids[skip * SIZE:len(hashes) * SIZE], block_size=SIZE, lora_id=None,
        medium="GPU", lora_name=None)])


class FakeNode:
    """A node's GET /kv_event_sources, pointing wherever the test says."""

    def __init__(self) -> None:
        self.sources: dict[str, dict] = {}
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/kv_event_sources", self._sources)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _sources(self, _request: web.Request) -> web.Response:
        return web.json_response(self.sources)


@pytest.fixture
async def node() -> AsyncIterator[FakeNode]:
    n = FakeNode()
    await n.start()
    yield n
    await n.runner.cleanup()


@pytest.fixture
async def events(node) -> AsyncIterator[tuple[KVEvents, PrefixIndex]]:
    index = PrefixIndex()
    async with aiohttp.ClientSession() as session:
        ev = KVEvents(index, lambda: [node.url], session, {}, resync_s=0.1)
        yield ev, index
        await ev.stop()


def _publisher(monkeypatch):
    from vllm.distributed.kv_events import ZmqEventPublisher

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    return ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")


def _config(pub) -> dict:
    return {"0": msgspec.to_builtins(pub.get_publisher_config().__dict__)}


def test_sources_are_parsed_leniently():
    assert parse_sources({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": None},
                          "1": {"enable_kv_cache_events": False}, "x": {}}) == {
        0: parse_sources({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": "tcp://10.0.0.1:5557"}})[0]}
    assert parse_sources([]) == {} and parse_sources({}) == {}


async def test_replay_then_live_from_vllms_publisher(node, events, monkeypatch):
    ev, index = events
    pub = _publisher(monkeypatch)
    try:
        pub.publish(_batch(PROMPT[:8]))  # stored before the proxy listened
        time.sleep(0.2)
        node.sources = _config(pub)
        assert node.sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
        ev.start()
        await until(lambda: index.cached_blocks(node.url, _ext(PROMPT)) == 2)
        pub.publish(_batch(PROMPT, skip=2))
        await until(lambda: index.cached_blocks(node.url, _ext(PROMPT)) == 4)
        src = index.source(node.url, 0)
        assert (src.seq, src.verified, src.mismatched) == (1, 4, 0)
    finally:
        pub.shutdown()


async def test_a_restarted_engine_is_dropped_and_followed_again(node, events, monkeypatch):
    ev, index = events
    first = _publisher(monkeypatch)
    second = _publisher(monkeypatch)
    try:
        first.publish(_batch(PROMPT))
        node.sources = _config(first)
        ev.start()
        await until(lambda: index.cached_blocks(node.url, _ext(PROMPT)) == 4)
        node.sources = _config(second)  # the engine came back on new ports, cache empty
        await until(lambda: index.source(node.url, 0).drops == 1)
        assert index.cached_blocks(node.url, _ext(PROMPT)) == 0
        second.publish(_batch(PROMPT[:4]))
        await until(lambda: index.cached_blocks(node.url, _ext(PROMPT)) == 1)
    finally:
        first.shutdown()
        second.shutdown()


class WirePublisher:
    """vLLM's wire protocol by hand (PUB of [topic, seq, payload]; a ROUTER replaying its
    buffer, then the end marker), so a test can lose a batch on the live stream."""

    def __init__(self, keep: int = 100) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.encoder = msgspec.msgpack.Encoder()
        self.kind = KVEventBatch
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://127.0.0.1:{pub_port}",
                              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}}
        self.buffer: list[tuple[int, bytes]] = []
        self.keep = keep
        self.seq = 0

    def publish(self, batch, live: bool = True) -> None:
        payload = self.encoder.encode(batch)
        self.buffer = [*self.buffer, (self.seq, payload)][-self.keep:]
        if live:
            self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def serve_replay(self) -> bool:
        if not self.router.poll(0):
            return False
        ident, _, start = self.router.recv_multipart()
        for seq, payload in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payload])
        self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        return True

    def close(self) -> None:
        self.ctx.destroy(linger=0)


async def _serving(pub: WirePublisher, check) -> None:
    async def step() -> bool:
        pub.serve_replay()
        return check()
    await until(step)


async def test_a_gap_is_filled_by_replay(node, events):
    ev, index = events
    pub = WirePublisher()
    try:
        node.sources = pub.sources
        ev.start()
        await _serving(pub, lambda: (pub.publish(_batch(PROMPT[:4])) or True)
                       and index.source(node.url, 0).seq >= 0)
        src = index.source(node.url, 0)
        drops = src.drops
        pub.publish(_batch(PROMPT[:8], skip=1), live=False)  # lost on the way
        pub.publish(_batch(PROMPT, skip=2))
        await _serving(pub, lambda: index.cached_blocks(node.url, _ext(PROMPT)) == 4)
        assert src.drops == drops and src.seq == pub.seq - 1
    finally:
        pub.close()


async def test_a_gap_replay_cannot_fill_drops_the_engine(node, events):
    ev, index = events
    pub = WirePublisher(keep=1)  # the buffer holds only the newest batch
    try:
        node.sources = pub.sources
        ev.start()
        await _serving(pub, lambda: (pub.publish(_batch(PROMPT[:4])) or True)
                       and index.source(node.url, 0).seq >= 0)
        src = index.source(node.url, 0)
        # (a batch lost while the subscription was joining may have dropped it already)
        await _serving(pub, lambda: index.cached_blocks(node.url, _ext(PROMPT)) == 1)
        drops = src.drops
        pub.publish(_batch([1] * 8), live=False)
        pub.publish(_batch([2] * 8), live=False)
        pub.publish(_batch([3] * 8))
        await _serving(pub, lambda: src.drops == drops + 1
                       and index.cached_blocks(node.url, _ext([3] * 8)) == 2)
        # What the engine held before the gap is forgotten; what came after is known.
        assert index.cached_blocks(node.url, _ext(PROMPT)) == 0
        assert index.cached_blocks(node.url, _ext([3] * 8)) == 2
    finally:
        pub.close()


async def test_a_failed_stream_drops_its_engine_and_subscribes_again(node, events,
                                                                    monkeypatch):
    ev, index = events
    pub = WirePublisher()
    real = KVEvents._subscribed
    calls = []

    async def flaky(self, src, ep):
        calls.append(1)
        if len(calls) == 1:  # the first subscription to the new sources fails
            raise zmq.ZMQError(zmq.ETERM)
        await real(self, src, ep)

    try:
        node.sources = pub.sources
        ev.start()
        await _serving(pub, lambda: (pub.publish(_batch(PROMPT[:4])) or True)
                       and index.cached_blocks(node.url, _ext(PROMPT)) == 1)
        monkeypatch.setattr(KVEvents, "_subscribed", flaky)
        # A restart's new sources: the failing subscription, then a good one.
        again = WirePublisher()
        node.sources = again.sources
        src = index.source(node.url, 0)
        await _serving(again, lambda: len(calls) >= 2 and src.drops >= 2)
        assert index.cached_blocks(node.url, _ext(PROMPT)) == 0
        await _serving(again, lambda: (again.publish(_batch(PROMPT)) or True)
                       and index.cached_blocks(node.url, _ext(PROMPT)) == 4)
        again.close()
    finally:
        pub.close()
