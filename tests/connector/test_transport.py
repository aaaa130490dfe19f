"""Two processes moving KV through Mooncake TCP on loopback, every byte verified.

A D peer allocates and registers its caches and publishes its session and regions; a P peer
fills its own caches, plans descriptors for random block tables on D with ``plan`` and writes
them with ``MooncakeTransport``; D then compares its whole cache with what it should hold.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.connector import kv_peer
from tests.connector.kv_peer import KVSpec, random_table

pytest.importorskip("torch")
pytest.importorskip("mooncake.engine")

HANG_GUARD_S = 60  # only catches hangs; no test asserts how fast anything is


class Peer:
    """Parent-side handle of a ``kv_peer.serve`` process."""

    def __init__(self, spec: KVSpec, **kw: Any) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=kv_peer.serve, args=(child, spec), kwargs=kw, daemon=True)
        self.proc.start()
        child.close()
        self.session = ""
        self.regions: list[tuple[int, int, int, int]] = []
        self.canary = 0
        self.spans: list[tuple[int, int]] = []

    def wait_ready(self) -> Peer:
        _, self.session, self.regions, self.canary, self.spans = self._recv()
        return self

    def _recv(self) -> Any:
        if not self.conn.poll(HANG_GUARD_S):
            raise AssertionError(f"peer pid {self.proc.pid} did not answer")
        return self.conn.recv()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self._recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except (AssertionError, BrokenPipeError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@contextmanager
def peers(p_spec: KVSpec, d_spec: KVSpec, **kw: Any) -> Iterator[tuple[Peer, Peer]]:
    p_kw, d_kw = kw.get("p_kw", {}), kw.get("d_kw", {})
    p, d = Peer(p_spec, **p_kw), Peer(d_spec, **d_kw)  # both start while we wait
    try:
        yield p.wait_ready(), d.wait_ready()
    finally:
        p.close()
        d.close()


def transfer_and_verify(
    p: Peer, d: Peer, src: list[int], dst: list[int], max_batch: int = 1024
) -> dict[str, Any]:
    status, result = p.call("write", d.session, d.regions, src, dst, max_batch)
    assert status == "ok", result
    bad_storages, canary_ok = d.call("verify", p.spec, src, dst)
    assert bad_storages == [] and canary_ok
    return result


def test_cpu_layout_random_block_tables() -> None:
    """docs/protocol.md's example 1P1D shape scaled down: 10 layers, hundreds of blocks,
    ~30 MiB moved."""
    p_spec = KVSpec(layers=10, num_blocks=320, seed=1)
    d_spec = KVSpec(layers=10, num_blocks=400, seed=2)
    rng = random.Random(11)
    with peers(p_spec, d_spec) as (p, d):
        assert len(d.regions) == 10 and len(d.spans) == 1  # layers share one registration
        src = random_table(rng, 210, p_spec.num_blocks)
        dst = random_table(rng, 200, d_spec.num_blocks)  # D had a 10-block prefix hit
        result = transfer_and_verify(p, d, src, dst)
        per_block = 2 * 4 * 16 * 64 * 2
        assert result["nbytes"] == 200 * 10 * per_block
        assert result["descriptors"] < 200 * 10  # runs coalesced
        # a second request into other blocks leaves the first one's blocks alone
        src2, dst2 = list(range(0, 63)), [b for b in range(400) if b not in dst][:63]
        status, _ = p.call("write", d.session, d.regions, src2, dst2, 1024)
        assert status == "ok"
        bad, _ = d.call("verify", p.spec, src + src2[-63:], dst + dst2)
        assert bad == []


def test_interleaved_layout_splits_more_than_1024_descriptors() -> None:
    """Blocks that do not touch need one descriptor each: 8 layers x 160 blocks = 1,280."""
    p_spec = KVSpec(layers=8, num_blocks=200, kv_heads=2, head_dim=32, layout="interleaved", seed=3)
    d_spec = KVSpec(layers=8, num_blocks=240, kv_heads=2, head_dim=32, layout="interleaved", seed=4)
    rng = random.Random(12)
    with peers(p_spec, d_spec) as (p, d):
        src = random_table(rng, 160, p_spec.num_blocks)
        dst = random_table(rng, 160, d_spec.num_blocks)
        result = transfer_and_verify(p, d, src, dst)
        assert result["descriptors"] == 1280 and result["batches"] == 2


def test_flash_layout_two_regions_per_layer() -> None:
    p_spec = KVSpec(layers=6, num_blocks=150, layout="flash", seed=5)
    d_spec = KVSpec(layers=6, num_blocks=180, layout="flash", seed=6)
    rng = random.Random(13)
    with peers(p_spec, d_spec) as (p, d):
        assert len(d.regions) == 12
        src = random_table(rng, 100, p_spec.num_blocks, max_run=12)
        dst = random_table(rng, 100, d_spec.num_blocks, max_run=12)
        transfer_and_verify(p, d, src, dst)
        free = max(set(range(d_spec.num_blocks)) - set(dst))
        status, result = p.call("write", d.session, d.regions, [7], [free], 1024)  # one block
        assert status == "ok" and result["descriptors"] == 12
        bad, _ = d.call("verify", p.spec, src + [7], dst + [free])
        assert bad == []


def test_bad_destinations_write_nothing() -> None:
    p_spec = KVSpec(layers=4, num_blocks=64, seed=7)
    d_spec = KVSpec(layers=4, num_blocks=64, seed=8)
    with peers(p_spec, d_spec) as (p, d):
        # D block ids beyond D's cache: refused while planning, before any byte moves
        status, kind, _ = p.call("write", d.session, d.regions, [1, 2, 3], [10, 11, 64], 1024)
        assert (status, kind) == ("error", "BlockRangeError")
        # a destination D never registered, and one straddling the end of its registration
        status, kind, msg = p.call("write_raw", d.session, d.canary, 4096)
        assert (status, kind) == ("error", "TransferError") and d.session in msg
        addr, length = d.spans[-1]
        status, kind, _ = p.call("write_raw", d.session, addr + length - 100, 4096)
        assert (status, kind) == ("error", "TransferError")
        bad, canary_ok = d.call("verify", p.spec, [], [])
        assert bad == [] and canary_ok
        # the pair still works after the failures
        transfer_and_verify(p, d, [5, 6, 7], [60, 61, 62])


def test_dead_peer_fails_at_once() -> None:
    p_spec = KVSpec(layers=2, num_blocks=16, seed=9)
    with peers(p_spec, p_spec) as (p, d):
        assert p.call("probe", d.session) is True
        d.close()
        assert p.call("probe", d.session) is False
        status, kind, msg = p.call("write", d.session, d.regions, [1], [2], 1024)
        assert (status, kind) == ("error", "TransferError") and d.session in msg


# --- the same across two network namespaces ---------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def two_namespaces() -> Iterator[tuple[str, str, str, str]]:
    """Namespaces joined by a veth pair; 10.77.x.y exists only inside them."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"pdt-{tag}-a", f"pdt-{tag}-b"
    octet = int(tag[:2], 16)
    ip_a, ip_b = f"10.77.{octet}.1", f"10.77.{octet}.2"
    created: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip(
            "link",
            "add",
            f"v{tag}a",
            "netns",
            a,
            "type",
            "veth",
            "peer",
            "name",
            f"v{tag}b",
            "netns",
            b,
        )
        for ns, dev, addr in ((a, f"v{tag}a", ip_a), (b, f"v{tag}b", ip_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, ip_a, ip_b
    finally:
        for ns in created:  # deleting a namespace deletes its veth end and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("ip") is None or os.geteuid() != 0, reason="needs root and iproute2"
)
def test_across_network_namespaces() -> None:
    p_spec = KVSpec(layers=8, num_blocks=200, seed=21)
    d_spec = KVSpec(layers=8, num_blocks=256, seed=22)
    rng = random.Random(14)
    with two_namespaces() as (ns_p, ns_d, ip_p, ip_d):
        kw = {"p_kw": {"host": ip_p, "netns": ns_p}, "d_kw": {"host": ip_d, "netns": ns_d}}
        with peers(p_spec, d_spec, **kw) as (p, d):
            assert d.session.startswith(f"{ip_d}:")
            src = random_table(rng, 150, p_spec.num_blocks)
            dst = random_table(rng, 150, d_spec.num_blocks)
            transfer_and_verify(p, d, src, dst)


# --- in-process checks that never create an engine --------------------------------------------


def test_start_rejects_bad_settings_before_touching_mooncake(tmp_path) -> None:
    from appliance.connector.transfers.mooncake import MooncakeTransport, TransferError

    t = MooncakeTransport()
    with pytest.raises(TransferError, match="protocol"):
        t.start("127.0.0.1", "udp")
    with pytest.raises(TransferError, match="mlx5_0 not found"):
        t.start("127.0.0.1", "rdma", "mlx5_0", sys_root=str(tmp_path))
    (tmp_path / "class" / "infiniband" / "mlx5_1").mkdir(parents=True)
    with pytest.raises(TransferError, match=r"mlx5_0 not found.*present: mlx5_1"):
        t.start("127.0.0.1", "rdma", "mlx5_1,mlx5_0", sys_root=str(tmp_path))
    with pytest.raises(TransferError, match="not started"):
        _ = t.session_id
    with pytest.raises(TransferError, match="not started"):
        t.register([(1, 1)])
    assert not t.started
    t.close()  # harmless before start
