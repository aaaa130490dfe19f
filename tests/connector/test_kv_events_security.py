"""KV events under the cluster's key (appliance.connector.kvevents): vLLM's own publisher
with CURVE server sockets. A subscriber with the key reads every batch, live and replayed;
one without a key, or with another key, completes no handshake and reads nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

from appliance.connector import kvevents
from appliance.proxy.prefix.wire import DECODER
from appliance.sidechannel.curve import CurveKey, generate_secret, read_key, set_client


def _key(tmp_path, name: str) -> CurveKey:
    path = tmp_path / name
    path.write_text(generate_secret() + "\n")
    return read_key(path)


@pytest.fixture
def cluster_key(tmp_path) -> CurveKey:
    return _key(tmp_path, "cluster.key")


@pytest.fixture
def publisher(cluster_key, monkeypatch) -> Iterator:
    """Built as vLLM's scheduler builds it, on 127.0.0.1 (VLLM_HOST_IP) at ports it picks;
    a batch published every 50 ms while the test runs (a PUB drops what it sends before a
    subscriber's handshake completes)."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    before = dict(EventPublisherFactory._registry)
    kvevents.install(cluster_key)
    try:
        pub = EventPublisherFactory.create(_config(), data_parallel_rank=0)
    finally:
        EventPublisherFactory._registry.clear()
        EventPublisherFactory._registry.update(before)
    stop = threading.Event()

    def publish() -> None:
        for i in range(400):  # bounded: 20 s at most
            if stop.wait(0.05):
                return
            pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[i], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                block_size=4, lora_id=None, medium=None, lora_name=None)]))

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    yield pub
    stop.set()
    thread.join(5)
    pub.shutdown()


def _config():
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                          endpoint="tcp://*:0", replay_endpoint="tcp://*:0")


def _subscribe(endpoint: str, key: CurveKey | None, within_s: float = 1.5) -> list:
    """The batches one subscriber reads within `within_s`."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    if key is not None:
        set_client(sub, key)
    sub.connect(endpoint)
    got = []
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if sub.poll(100):
                frames = sub.recv_multipart()
                got.append(DECODER.decode(frames[-1]))
    finally:
        sub.close()
        ctx.term()
    return got


def _replay(endpoint: str, key: CurveKey | None) -> list:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        set_client(sock, key)
    sock.connect(endpoint)
    got = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while sock.poll(1500):
            frames = sock.recv_multipart()
            if int.from_bytes(frames[2], "big", signed=True) == -1:
                break
            got.append(DECODER.decode(frames[3]))
    finally:
        sock.close()
        ctx.term()
    return got


def test_the_publisher_binds_the_node_address_under_the_key(publisher) -> None:
    config = publisher.get_publisher_config()
    assert config.publisher == "zmq"  # the kind keeps vLLM's name
    assert config.endpoint.startswith("tcp://127.0.0.1:")
    assert publisher._pub.curve_server and publisher._replay.curve_server


def test_a_subscriber_with_the_key_reads_live_and_replayed_batches(publisher,
                                                                  cluster_key) -> None:
    config = publisher.get_publisher_config()
    live = _subscribe(config.endpoint, cluster_key)
    assert live and live[0].events[0].token_ids == [1, 2, 3, 4]
    replayed = _replay(config.replay_endpoint, cluster_key)
    assert replayed and replayed[0].events[0].token_ids == [1, 2, 3, 4]


@pytest.mark.parametrize("who", ["no key", "another key"])
def test_a_subscriber_without_the_key_reads_nothing(publisher, tmp_path, who) -> None:
    config = publisher.get_publisher_config()
    key = None if who == "no key" else _key(tmp_path, "other.key")
    assert _subscribe(config.endpoint, key) == []
    assert _replay(config.replay_endpoint, key) == []
