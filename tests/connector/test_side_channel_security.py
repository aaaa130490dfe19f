"""The side channel secured: CURVE with the cluster's one key, bounded messages, block ids
checked against D's cache and a Mooncake session only D's own. A real Sender (and Receiver)
on loopback, real ZMQ and Mooncake TCP, as in test_side_channel: every refusal is counted,
logged, and leaves D's memory untouched and the transfer unserved."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
import zmq.asyncio

from appliance.connector.planning.plan import Region
from appliance.connector.settings import ConnectorSettings
from appliance.connector.sidechannel import guard
from appliance.connector.stats import TransferStats
from appliance.connector.transfers.receiver import Receiver
from appliance.connector.transfers.sender import Sender
from appliance.connector.transfers.state import TransferState
from appliance.sidechannel import curve
from appliance.sidechannel import messages as m
from tests.connector.test_side_channel import BLOCKS, Pair, RawDealer, request


class Dealer(RawDealer):
    """A RawDealer that may speak CURVE (`key`, trusting `server`: by default the key's own
    public key, as the cluster's clients do) and connect from `source`."""

    def __init__(self, addr: str, key: curve.CurveKey | None = None,
                 server: bytes | None = None, source: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if key is not None:
            curve.set_client(self.sock, key)
            self.sock.curve_serverkey = server or key.public
        self.sock.connect(addr.replace("tcp://", f"tcp://{source}:0;") if source else addr)

    async def silent(self, payload: bytes, wait: float = 0.5) -> None:
        """Send; no answer may come (the handshake was refused)."""
        await asyncio.wait_for(self.sock.send(payload), 1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(self.sock.recv(), wait)


async def until(check: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.02)


def other_key() -> curve.CurveKey:
    secret = curve.generate_secret().encode()
    return curve.CurveKey(secret, zmq.curve_public(secret))


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "side-channel.key"
    path.write_text(curve.generate_secret() + "\n")
    return path


@pytest.fixture
def key(key_file) -> curve.CurveKey:
    return curve.read_key(key_file)


@pytest.fixture
async def make_pair(bootstrap_url, key_file):
    """A Pair whose P and D both hold the key, with other settings overridden."""
    made: list[Pair] = []

    async def make(**overrides) -> Pair:
        pr = Pair(bootstrap_url, side_channel_key_file=str(key_file), **overrides)
        made.append(pr)
        await pr.start()
        return pr

    yield make
    for pr in made:
        await pr.close()


@pytest.fixture
async def secure(make_pair) -> Pair:
    return await make_pair()


@pytest.fixture
def sender_log(caplog):
    loggers = [logging.getLogger(f"vllm.appliance.connector.{n}") for n in ("sender", "curve")]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        # vLLM's "vllm" logger may not propagate to root (where caplog listens): listen here,
        # and only here, so that each record is seen once.
        lg.addHandler(caplog.handler)
        lg.propagate = False
    caplog.set_level(logging.WARNING)
    yield caplog
    for lg, propagate in zip(loggers, saved, strict=True):
        lg.removeHandler(caplog.handler)
        lg.propagate = propagate


def unserved(pair: Pair, transfer_id: str) -> None:
    """P's KV for it still waits, no decode node recorded; D's cache all zeros."""
    t = pair.sender.by_transfer[transfer_id]
    assert t.d_req_id is None and t.state is TransferState.WAITING_FOR_INPUT
    assert pair.p.stats.totals["transfers"] == 0
    pair.assert_untouched()


def rejected(pair: Pair, reason: str) -> int:
    return pair.p.stats.totals[f"rejected_{reason}"]


# ---- CURVE ---------------------------------------------------------------------------------

async def test_plain_client_is_refused_and_nothing_is_written(secure, sender_log):
    secure.sender.on_ready("p1", "x1", [[1, 2]], None)
    plain = Dealer(secure.sender.side_channel_addr)
    try:
        await plain.silent(m.encode_request(request(secure, [("d1", "x1", [[5, 6]])])))
    finally:
        plain.close()
    await until(lambda: rejected(secure, "handshake") >= 1)
    await asyncio.sleep(0.3)  # the events of its last reconnects
    unserved(secure, "x1")
    refusals = [r for r in sender_log.records if "refused a handshake" in r.message]
    assert refusals  # "does not speak CURVE", or the client hung up mid-handshake first
    assert secure.p.stats.totals["rejected"] == rejected(secure, "handshake") == len(refusals)


@pytest.mark.parametrize("who", ["client key", "server key"])
async def test_other_key_is_refused_and_nothing_is_written(secure, key, who, sender_log):
    """Another cluster's keypair (ZAP denies it), or ours trusting another server key (our
    server cannot read its hello)."""
    secure.sender.on_ready("p1", "x1", [[1, 2]], None)
    stranger = (Dealer(secure.sender.side_channel_addr, other_key(), server=key.public)
                if who == "client key" else
                Dealer(secure.sender.side_channel_addr, key, server=other_key().public))
    try:
        await stranger.silent(m.encode_request(request(secure, [("d1", "x1", [[5, 6]])])))
    finally:
        stranger.close()
    reason = "auth" if who == "client key" else "handshake"
    await until(lambda: rejected(secure, reason) >= 1)
    await asyncio.sleep(0.3)
    unserved(secure, "x1")
    if who == "client key":  # logged once by the ZAP handler, with the peer and its key
        denials = [r.message for r in sender_log.records if "refused CURVE client" in r.message]
        assert len(denials) == rejected(secure, "auth") and "127.0.0.1" in denials[0]


async def test_the_clusters_key_moves_kv_byte_for_byte(secure):
    """D's receiver and P's sender with the key on both sides: the ordinary transfer."""
    secure.sender.on_ready("p1", "x1", [[3, 4, 5, 9]], None)
    secure.receiver.on_recv("d1", secure.spec("x1", [10, 11, 12, 40]))
    assert await secure.results() == ({"d1"}, set())
    secure.assert_copied([3, 4, 5, 9], [10, 11, 12, 40])
    secure.assert_untouched({10, 11, 12, 40})
    assert secure.p.stats.totals["rejected"] == 0


async def test_proxy_release_needs_the_key(secure, key):
    from appliance.proxy.metrics import ProxyMetrics
    from appliance.proxy.nodes.backends import PrefillBackend
    from appliance.proxy.ownership.kv import PrefillKV
    from appliance.proxy.ownership.release import KVReleaser

    p = PrefillBackend(role="prefill", url="http://p",
                       side_channels={0: [secure.sender.side_channel_addr]})
    secure.sender.on_ready("p1", "x1", [[1, 2]], None)
    secure.sender.on_finished({"p1"})
    keyless, keyed = KVReleaser(ProxyMetrics()), KVReleaser(ProxyMetrics(), curve_key=key)
    try:
        keyless.release(PrefillKV(p, 0, "x1"))
        await until(lambda: rejected(secure, "handshake") >= 1)
        await asyncio.sleep(0.3)
        assert secure.sender.take_finished() == set()  # still held (send_timeout_s is 3)
        # the keyless proxy learned it from its own handshake, counted it, dropped the socket
        await until(lambda: keyless.metrics.kv_releases.labels("refused")._value.get() >= 1)
        await until(lambda: not keyless._socks)
        keyed.release(PrefillKV(p, 0, "x1"))
        assert await secure.finished_sending(2) == {"p1"}
    finally:
        await keyless.close()
        await keyed.close()


# ---- limits, blocks, sessions (over CURVE: a key holder is bounded too) --------------------

@pytest.fixture
async def keyed(secure, key):
    d = Dealer(secure.sender.side_channel_addr, key)
    yield d
    d.close()


async def test_oversized_message_is_refused_before_decoding(make_pair, key, sender_log):
    pair = await make_pair(max_message_bytes=4096)
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)
    d = Dealer(pair.sender.side_channel_addr, key)
    try:
        big = request(pair, [("d" * 4000, "x1", [[5, 6]])])  # valid, just large
        resp = await d.ask(m.encode_request(big))
        assert resp.status is m.Status.ERROR and "max_message_bytes" in resp.message
        assert resp.failed == {}  # not decoded: no ids to name
        resp = await d.ask(b"\x00" * 5000)  # over the bound: "size", not "invalid"
        assert resp.status is m.Status.ERROR and "max_message_bytes" in resp.message
    finally:
        d.close()
    assert rejected(pair, "size") == 2 and rejected(pair, "invalid") == 0
    unserved(pair, "x1")
    assert any("(size) engine=?" in r.message for r in sender_log.records)


async def test_too_many_entries_are_refused_before_any_record(make_pair, key, sender_log):
    pair = await make_pair(max_message_entries=4)
    d = Dealer(pair.sender.side_channel_addr, key)
    try:
        entries = [(f"d{i}", f"x{i}", [[i]]) for i in range(5)]
        resp = await d.ask(m.encode_request(request(pair, entries)))
        assert resp.status is m.Status.ERROR and "max_message_entries" in resp.message
        assert pair.sender.by_transfer == {}  # no task or transfer record for any of them
        pair.sender.on_ready("p1", "x1", [[1, 2]], None)
        pair.sender.on_finished({"p1"})
        releases = m.CancelRequest("d0", [m.CancelEntry.release(f"x{i}") for i in range(5)])
        resp = await d.ask(m.encode_cancel(releases))
        assert resp.status is m.Status.ERROR
        assert pair.sender.take_finished() == set()  # x1 was not released
    finally:
        d.close()
    assert rejected(pair, "entries") == 2
    unserved(pair, "x1")
    assert any("engine=d0 transfers=x0,x1,x2,x3,+1" in r.message for r in sender_log.records)


async def test_blocks_beyond_a_cached_layout_are_refused(secure, keyed):
    """The layout came in an earlier message; a later one names blocks past D's cache (or
    another group count): P must not write past D's registered cache."""
    resp = await keyed.ask(m.encode_request(request(secure, [("d0", "x0", [[]])], layout_id=5)))
    assert resp.status is m.Status.FINISH and resp.ok == ["d0"]  # layout 5 now cached
    secure.sender.on_ready("p1", "x1", [[1, 2]], None)
    for blocks, words in (([[3, BLOCKS]], f"beyond D's {BLOCKS} blocks"),
                          ([[3], [4]], "2 KV-cache groups")):
        resp = await keyed.ask(m.encode_request(request(
            secure, [("d1", "x1", blocks)], layout=False, layout_id=5)))
        assert resp.status is m.Status.ERROR and words in resp.failed["d1"], resp
    assert rejected(secure, "blocks") == 2
    unserved(secure, "x1")
    resp = await keyed.ask(m.encode_request(request(
        secure, [("d1", "x1", [[3, 4]])], layout=False, layout_id=5)))
    assert resp.status is m.Status.FINISH and resp.ok == ["d1"]  # in bounds: served
    secure.assert_copied([1, 2], [3, 4])


async def test_session_on_another_host_is_refused(secure, keyed):
    secure.sender.on_ready("p1", "x1", [[1, 2]], None)
    req = msgspec.structs.replace(request(secure, [("d1", "x1", [[5, 6]])]), host="10.9.8.7")
    resp = await keyed.ask(m.encode_request(req))
    assert resp.status is m.Status.ERROR and "internal_networks" in resp.failed["d1"]
    assert rejected(secure, "session") == 1
    unserved(secure, "x1")
    assert secure.sender._layouts == {}  # noqa: SLF001 - not even its layout was kept


@pytest.mark.parametrize("internal", [None, ("127.0.0.0/8",)])
async def test_session_elsewhere_than_the_peer_needs_internal_networks(make_pair, key,
                                                                       internal):
    """D's request comes from 127.0.0.2, its Mooncake session is at 127.0.0.1 (another NIC):
    accepted only when internal_networks holds that address."""
    pair = await make_pair(internal_networks=internal)
    pair.sender.on_ready("p1", "x1", [[1, 2]], None)
    d = Dealer(pair.sender.side_channel_addr, key, source="127.0.0.2")
    try:
        resp = await d.ask(m.encode_request(request(pair, [("d1", "x1", [[5, 6]])])))
    finally:
        d.close()
    if internal is None:
        assert resp.status is m.Status.ERROR and "127.0.0.2" in resp.failed["d1"]
        assert rejected(pair, "session") == 1
        unserved(pair, "x1")
    else:
        assert resp.status is m.Status.FINISH and resp.ok == ["d1"]
        pair.assert_copied([1, 2], [5, 6])
        assert pair.p.stats.totals["rejected"] == 0


# ---- the pure parts ------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "words"), [
    (None, "No such file"),
    ("", "is empty"),
    (" \n\n", "is empty"),
    ("short\n", "does not hold"),
    ("~" * 40, "does not hold"),  # not Z85
    ("#" * 40, "does not hold"),  # Z85, but not a 32-bit value per 5 characters
    (f"{curve.generate_secret()}\n{curve.generate_secret()}\n", "does not hold"),
])
def test_read_key_errors_are_one_line_naming_the_file(tmp_path, content, words):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        curve.read_key(path)
    assert words in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_read_key_derives_the_public_key(key_file):
    key = curve.read_key(str(key_file))
    assert len(key.secret) == 40 and key.public == zmq.curve_public(key.secret)
    assert key.secret.decode() not in repr(key)  # never logged by accident


def test_a_bad_key_file_fails_the_worker_start(tmp_path):
    for role, side in (("producer", Sender), ("consumer", Receiver)):
        s = ConnectorSettings(engine_id="e", role=role,
                              side_channel_key_file=str(tmp_path / "missing"))
        with pytest.raises(ValueError, match="side-channel key file"):
            if side is Sender:
                Sender(s, None, [], "127.0.0.1", 0, 1, 0, TransferStats())  # type: ignore[arg-type]
            else:
                Receiver(s, None, [], "127.0.0.1", 0, 1, TransferStats())  # type: ignore[arg-type]


def test_rejections_are_counted_by_reason():
    stats = TransferStats()
    stats.record_rejected("size")
    stats.record_rejected("auth")
    stats.record_rejected("size")
    snap = stats.snapshot()
    assert snap is not None
    out = snap.reduce()
    assert out["rejected_messages"] == 3 and out["rejected_size"] == 2
    assert out["rejected_auth"] == 1 and "rejected_session" not in out
    assert snap.aggregate(snap).data["rejected_size"] == 4


def test_check_session_addresses():
    lan = guard.networks(["10.0.0.0/8", "fd00::/8"])
    assert guard.check_session("10.1.2.3", "10.1.2.3", ()) is None
    assert guard.check_session("10.1.2.3", "::ffff:10.1.2.3", ()) is None
    assert guard.check_session("[fd00::1]", "fd00::1", ()) is None
    assert guard.check_session("10.1.2.3", "192.168.0.9", lan) is None
    assert "neither" in guard.check_session("192.168.7.7", "192.168.0.9", lan)
    assert "neither" in guard.check_session("10.1.2.3", None, ())
    assert "not an IP" in guard.check_session("d-host.example", "10.1.2.3", lan)


def test_check_blocks_uses_the_smallest_cache_and_its_groups():
    layout = [Region(0, 100, 100, 8, 0), Region(4096, 100, 100, 8, 1)]
    ok = m.TransferRequest("d0", "127.0.0.1", 1, 1, [m.ReqEntry("d1", "x1", [[7], [0, 7]])])
    assert guard.check_blocks(ok, layout) is None
    past = msgspec.structs.replace(ok, reqs=[m.ReqEntry("d1", "x1", [[8], []])])
    assert "beyond D's 8 blocks" in guard.check_blocks(past, layout)
    one = msgspec.structs.replace(ok, reqs=[m.ReqEntry("d1", "x1", [[1]])])
    assert "groups" in guard.check_blocks(one, layout)


def test_refusal_warnings_are_throttled(caplog):
    from appliance.sidechannel.curve import _Throttled

    t = _Throttled(every_s=60)
    with caplog.at_level("WARNING", logger="vllm.appliance.sidechannel.curve"):
        for _ in range(5):
            t.warning("auth", "refused %s", "x")
        t.warning("handshake", "refused %s", "y")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused x", "refused y"]
    start, lines = t._window["auth"]
    t._window["auth"] = (start - 61, lines)  # a minute later: one line, saying how many
    with caplog.at_level("WARNING", logger="vllm.appliance.sidechannel.curve"):
        t.warning("auth", "refused %s", "z")
    assert caplog.records[-1].getMessage() == "refused z (4 more like it in the last 60 s)"


@pytest.mark.parametrize("d_key", ["another", "none"])
async def test_a_decode_node_refused_by_the_producer_fails_its_pull_at_once(secure, tmp_path,
                                                                            d_key):
    """Keys that differ (a rotation not done on every host) or a D without CURVE: D learns
    from its own handshake and fails the pull now, not at recv_timeout_s; nothing written."""
    other = tmp_path / "other.key"
    other.write_text(curve.generate_secret() + "\n")
    settings = secure.d_settings.model_copy(update={
        "recv_timeout_s": 30.0,
        "side_channel_key_file": str(other) if d_key == "another" else None})
    await secure.receiver.close()
    secure.receiver = Receiver(settings, secure.d.transport, secure.d.regions, "127.0.0.1", 0,
                               1, secure.d.stats)
    secure.sender.on_ready("p1", "x1", [[1, 2]], None)
    started = time.monotonic()
    secure.receiver.on_recv("d1", secure.spec("x1", [5, 6]))
    assert await secure.results(timeout=10) == ({"d1"}, {"d1"})
    assert time.monotonic() - started < 5  # not the 30 s receive deadline
    assert secure.d.stats.totals["rejected_handshake"] >= 1
    assert not secure.receiver._peers  # the refused socket and its queue are gone
    unserved(secure, "x1")
