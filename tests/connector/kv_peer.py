"""A KV peer for the transport tests: one process owning KV caches and a MooncakeTransport.

The test process drives a P peer and a D peer over multiprocessing pipes. Cache contents come
from a seeded generator, so D can rebuild P's cache locally and check every byte it received
without shipping tens of MiB through the pipe.
"""

from __future__ import annotations

import ctypes
import os
import random
from dataclasses import asdict, astuple, dataclass
from multiprocessing.connection import Connection
from typing import Any

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class KVSpec:
    """A model's KV cache shape on one side; ``layout`` picks how tensors sit in memory."""

    layers: int = 8
    num_blocks: int = 256
    kv_heads: int = 4
    block_size: int = 16
    head_dim: int = 64
    layout: str = "cpu"  # cpu | interleaved | flash
    seed: int = 0
    device: str = "cpu"  # cuda: GPU memory (tests/gpu), through Mooncake's CUDA build

    @property
    def block_dim(self) -> int:
        return 1 if self.layout == "flash" else 0

    @property
    def nbytes(self) -> int:
        return (
            2 * self.layers * self.num_blocks * self.kv_heads * self.block_size * self.head_dim * 2
        )


def make_caches(spec: KVSpec) -> tuple[list[Any], list[Any]]:
    """(storages, per-layer tensors) filled with the pattern that ``spec.seed`` fixes.

    cpu: vLLM 0.32's LBHNC, every layer a [B, H, N, C] view into one buffer (facts file).
    interleaved: vLLM 0.32's BLHNC, one buffer [num_blocks, layers, ...], so a layer's
    blocks do not touch.
    flash: the legacy flash-attention layout, one [2, num_blocks, block_size, kv_heads,
    head_dim] tensor per layer.
    The pattern is drawn on the CPU and copied, so both devices hold the same bytes.
    """
    import torch

    s = spec
    bf16 = torch.bfloat16
    dev = torch.device(s.device)
    if s.layout == "cpu":
        buf = torch.empty(
            s.layers * s.num_blocks * s.kv_heads * s.block_size * 2 * s.head_dim,
            dtype=bf16,
            device=dev,
        )
        storages = [buf]
        layers = [
            c.view(s.num_blocks, s.kv_heads, s.block_size, 2 * s.head_dim)
            for c in buf.chunk(s.layers)
        ]
    elif s.layout == "interleaved":
        buf = torch.empty(
            s.num_blocks, s.layers, s.kv_heads, s.block_size, 2 * s.head_dim, dtype=bf16,
            device=dev,
        )
        storages = [buf]
        layers = [buf[:, i] for i in range(s.layers)]
    elif s.layout == "flash":
        storages = [
            torch.empty(
                2, s.num_blocks, s.block_size, s.kv_heads, s.head_dim, dtype=bf16, device=dev
            )
            for _ in range(s.layers)
        ]
        layers = storages
    else:
        raise ValueError(f"unknown layout {s.layout!r}")
    gen = torch.Generator().manual_seed(s.seed)
    for storage in storages:
        raw = storage.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return storages, layers


def random_table(rng: random.Random, n: int, num_blocks: int, max_run: int = 6) -> list[int]:
    """``n`` distinct block ids in shuffled runs of 1..max_run consecutive ids."""
    chunks, start = [], 0
    while start < num_blocks:
        k = rng.randint(1, max_run)
        chunks.append(range(start, min(start + k, num_blocks)))
        start += k
    rng.shuffle(chunks)
    return [b for c in chunks for b in c][:n]


def enter_netns(name: str) -> None:
    """Move this (still single-purpose) process into network namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def serve(
    conn: Connection, spec: KVSpec, host: str = "127.0.0.1", netns: str | None = None
) -> None:
    """Run one peer: answer commands from ``conn`` until told to exit."""
    if netns:
        enter_netns(netns)  # before Mooncake starts threads, so they all live there
    import torch

    from appliance.connector.planning.descriptors import build_descriptors
    from appliance.connector.planning.plan import PlanError, Region, TensorInfo
    from appliance.connector.planning.plan import registration_spans as spans_of
    from appliance.connector.transfers.mooncake import MooncakeTransport, TransferError

    transport = MooncakeTransport()
    session = transport.start(host, "tcp")
    storages, layers = make_caches(spec)
    infos = [TensorInfo.from_tensor(t) for t in layers]
    regions = [r for i in infos for r in i.regions(spec.num_blocks, spec.block_dim)]
    spans = spans_of(infos)
    transport.register(spans)
    canary = torch.full((1 << 16,), 0xAB, dtype=torch.uint8, device=spec.device)  # unregistered
    conn.send(("ready", session, [astuple(r) for r in regions], canary.data_ptr(), spans))

    def write(session: str, descs: Any, max_batch: int) -> tuple:
        try:
            return ("ok", asdict(transport.write(session, descs, max_batch)))
        except (PlanError, TransferError) as exc:
            return ("error", type(exc).__name__, str(exc))

    while True:
        cmd, *args = conn.recv()
        if cmd == "write":  # plan with our regions and D's, then write
            peer, dst_regions, src_ids, dst_ids, max_batch = args
            try:
                descs = build_descriptors(
                    regions, [Region(*r) for r in dst_regions], src_ids, dst_ids
                )
            except PlanError as exc:
                conn.send(("error", type(exc).__name__, str(exc)))
                continue
            conn.send(write(peer, descs, max_batch))
        elif cmd == "write_raw":  # our first block to an arbitrary destination address
            from appliance.connector.planning.descriptors import Descriptors

            peer, dst_addr, length = args
            conn.send(write(peer, Descriptors([regions[0].base_addr], [dst_addr], [length]), 1024))
        elif cmd == "probe":
            conn.send(transport.probe(args[0]))
        elif cmd == "verify":  # every byte: written blocks hold P's, the rest our own pattern
            p_spec, src_ids, dst_ids = args
            _, p_layers = make_caches(p_spec)
            expected_storages, expected = make_caches(spec)
            src_ids = src_ids[len(src_ids) - len(dst_ids) :]
            for want, theirs in zip(expected, p_layers, strict=True):
                theirs = theirs.to(want.device)  # P's cache may live on another device
                if spec.block_dim == 0:
                    want[dst_ids] = theirs[src_ids]
                else:
                    want[:, dst_ids] = theirs[:, src_ids]
            bad = [
                i
                for i, (got, want) in enumerate(zip(storages, expected_storages, strict=True))
                if not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
            ]
            conn.send((bad, bool((canary == 0xAB).all())))
        elif cmd == "exit":
            transport.close()
            conn.send("bye")
            return
