"""The connector's KV transfer path vs a raw Mooncake batch write vs memcpy, in one run.

docs/protocol.md's example (Qwen3-8B: 36 layers, 8 KV heads, head_dim 128, bf16, block 16):
P sends its blocks 17..79 into D's blocks 512..574, 63 blocks = 141.75 MiB, in vLLM's CPU KV
layout.
D runs in its own process, P in another, over Mooncake TCP on loopback:

- ours:   descriptors.build_descriptors (timed) + MooncakeTransport.write
- raw:    TransferEngine.batch_transfer_sync_write with hand-made descriptors, same bytes
- memcpy: torch copy of the same bytes inside P

Each configuration (MC_TCP_SLICE_SIZE unset / 1 MiB) gets fresh engines. Also a fragmented
case: random, mostly non-consecutive block tables (one descriptor per block and region).
Usage: .venv/bin/python bench/transfer.py [--reps 7] [--layers 36] [--blocks 63]
       [--device cuda]  (on a GPU host: both caches in GPU memory; memcpy is a GPU gather)
       bench/transfer.py --model all  (MLA, sliding window, TP 1->2 and 2->1: bench/kvcases)
       bench/transfer.py --auth both  (the whole side-channel path, CURVE off vs on:
                                       bench/sidechannel)
       bench/transfer.py --verify both  (the same path, verify_kv off vs all)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcases import CASES, report, run_pd  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    blocks: int  # blocks moved per transfer
    p_first: int
    d_first: int
    device: str = "cpu"  # cuda: GPU memory on both sides (Mooncake's CUDA build)

    @property
    def chunk(self) -> int:  # bytes per block per layer: K and V, bf16
        return 2 * self.kv_heads * self.block_size * self.head_dim * 2

    @property
    def p_blocks(self) -> int:
        return self.p_first + self.blocks

    @property
    def d_blocks(self) -> int:
        return self.d_first + self.blocks

    @property
    def nbytes(self) -> int:
        return self.layers * self.blocks * self.chunk


def kv_cache(shape: Shape, num_blocks: int, fill: bool) -> tuple[Any, list[Any]]:
    """vLLM's LBHNC layout: one buffer, each layer a [blocks, heads, block_size, 2*dim] view."""
    import torch

    buf = torch.empty(shape.layers * num_blocks * shape.chunk, dtype=torch.uint8)
    if fill:
        buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    buf = buf.to(shape.device)
    layers = [
        c.view(torch.bfloat16).view(
            num_blocks, shape.kv_heads, shape.block_size, 2 * shape.head_dim
        )
        for c in buf.chunk(shape.layers)
    ]
    return buf, layers


def pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core % os.cpu_count()})


def d_main(conn: Connection, shape: Shape, core: int | None = None) -> None:
    """D: allocate and register the cache, publish session and regions, wait."""
    pin(core)
    from appliance.connector.planning.plan import TensorInfo, registration_spans
    from appliance.connector.transfers.mooncake import MooncakeTransport

    transport = MooncakeTransport()
    session = transport.start("127.0.0.1", "tcp")
    _buf, layers = kv_cache(shape, shape.d_blocks, fill=False)
    infos = [TensorInfo.from_tensor(t) for t in layers]
    transport.register(registration_spans(infos))
    regions = [r for i in infos for r in i.regions(shape.d_blocks, 0)]
    conn.send((session, regions))
    conn.recv()  # exit
    transport.close()


class PSide:
    """P's process: its cache, our transport, a raw engine, and the three ways to move bytes."""

    def __init__(self, shape: Shape, d_session: str, d_regions: list[Any]) -> None:
        import torch
        from mooncake.engine import TransferEngine

        from appliance.connector.planning.plan import TensorInfo, registration_spans
        from appliance.connector.transfers.mooncake import MooncakeTransport

        # One thread: two OpenMP threads on this 2-core, shared machine stall each other at
        # every barrier whenever Mooncake's or anyone's thread runs (10x swings in memcpy).
        torch.set_num_threads(1)
        self.shape, self.d_session, self.d_regions = shape, d_session, d_regions
        self.transport = MooncakeTransport()
        self.transport.start("127.0.0.1", "tcp")
        self.buf, self.layers = kv_cache(shape, shape.p_blocks, fill=True)
        infos = [TensorInfo.from_tensor(t) for t in self.layers]
        spans = registration_spans(infos)
        self.transport.register(spans)
        self.p_regions = [r for i in infos for r in i.regions(shape.p_blocks, 0)]
        self.raw = TransferEngine()  # a second engine: raw Mooncake, none of our code
        assert self.raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert self.raw.batch_register_memory([a for a, _ in spans], [n for _, n in spans]) == 0
        self.sink = torch.empty(shape.nbytes, dtype=torch.uint8, device=shape.device)
        self.plan_s: list[float] = []

    def hand_descriptors(self, src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
        """The raw path's descriptors, written out from the known layout: no planning code."""
        sh = self.shape
        p_base, d_base = self.p_regions[0].base_addr, self.d_regions[0].base_addr
        p_per, d_per, chunk = sh.p_blocks * sh.chunk, sh.d_blocks * sh.chunk, sh.chunk
        if src == list(range(src[0], src[0] + len(src))) and dst == list(
            range(dst[0], dst[0] + len(dst))
        ):
            return [
                (
                    p_base + li * p_per + src[0] * chunk,
                    d_base + li * d_per + dst[0] * chunk,
                    len(src) * chunk,
                )
                for li in range(sh.layers)
            ]
        return [
            (p_base + li * p_per + s * chunk, d_base + li * d_per + t * chunk, chunk)
            for li in range(sh.layers)
            for s, t in zip(src, dst, strict=True)
        ]

    def ours(self, src: list[int], dst: list[int]) -> None:
        from appliance.connector.planning.descriptors import build_descriptors
        from appliance.connector.transfers.outgoing import Outgoing

        t = time.perf_counter()
        descs = build_descriptors(self.p_regions, self.d_regions, src, dst)
        self.plan_s.append(time.perf_counter() - t)
        # As the sender writes: asked before every batch whether to stop.
        stop = Outgoing(transfer_id="bench", write_by=time.monotonic() + 3600).stop_reason
        self.transport.write(self.d_session, descs, stop=stop)

    def rawwrite(self, batches: list[tuple[list[int], list[int], list[int]]]) -> None:
        for srcs, dsts, lens in batches:
            assert self.raw.batch_transfer_sync_write(self.d_session, srcs, dsts, lens) == 0

    def memcpy(self, src: list[int], idx: Any) -> None:
        import torch

        sh = self.shape
        step = len(src) * sh.chunk
        contiguous = src == list(range(src[0], src[0] + len(src)))
        for li, layer in enumerate(self.layers):
            out = self.sink[li * step : (li + 1) * step].view(torch.bfloat16)
            out = out.view(len(src), *layer.shape[1:])
            if contiguous:
                out.copy_(layer[src[0] : src[0] + len(src)])
            else:  # a gather: the same bytes the fragmented transfer moves
                torch.index_select(layer, 0, idx, out=out)
        if self.shape.device != "cpu":
            torch.cuda.synchronize()

    def measure(self, src: list[int], dst: list[int], reps: int, deadline: float) -> dict:
        import torch

        from appliance.connector.planning.descriptors import build_descriptors, split_batches

        hand = self.hand_descriptors(src, dst)
        descs = build_descriptors(self.p_regions, self.d_regions, src, dst)
        assert descs.total_bytes == self.shape.nbytes
        assert sorted(zip(descs.srcs, descs.dsts, descs.lengths, strict=True)) == sorted(hand)
        batches = [
            tuple(map(list, zip(*hand[i : i + 1024], strict=True)))
            for i in range(0, len(hand), 1024)
        ]
        idx = torch.tensor(src, device=self.shape.device)
        methods = {
            "ours": lambda: self.ours(src, dst),
            "raw": lambda: self.rawwrite(batches),
            "memcpy": lambda: self.memcpy(src, idx),
        }
        for fn in methods.values():  # warm-up: handshakes, page faults
            fn()
        self.plan_s.clear()
        times: dict[str, list[float]] = {k: [] for k in methods}
        names = list(methods)
        for rep in range(reps):  # rotate the order so drift and neighbours hit all alike
            for name in names[rep % 3 :] + names[: rep % 3]:
                t = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t)
            if time.monotonic() > deadline:
                break
        return {
            "median": {k: statistics.median(v) for k, v in times.items()},
            "plan": statistics.median(self.plan_s),
            "reps": len(times["ours"]),
            "descs": len(descs),
            "batches": len(split_batches(descs)),
            "raw_descs": len(hand),
        }


def p_main(
    conn: Connection, shape: Shape, reps: int, budget_s: float, core: int | None = None
) -> None:
    pin(core)
    deadline = time.monotonic() + budget_s
    d_session, d_regions = conn.recv()
    p = PSide(shape, d_session, d_regions)
    rng = random.Random(5)
    tables = {
        "contiguous": (
            list(range(shape.p_first, shape.p_blocks)),
            list(range(shape.d_first, shape.d_blocks)),
        ),
        "fragmented": (
            rng.sample(range(shape.p_blocks), shape.blocks),
            rng.sample(range(shape.d_blocks), shape.blocks),
        ),
    }
    half = (deadline - time.monotonic()) / 2
    results = {
        "contiguous": p.measure(*tables["contiguous"], reps, time.monotonic() + half),
    }
    results["fragmented"] = p.measure(*tables["fragmented"], reps, deadline)
    conn.send(results)
    p.transport.close()


def run_config(
    shape: Shape, reps: int, slice_size: str | None, budget_s: float, pinned: bool
) -> dict:
    saved = os.environ.get("MC_TCP_SLICE_SIZE")
    if slice_size is None:
        os.environ.pop("MC_TCP_SLICE_SIZE", None)
    else:
        os.environ["MC_TCP_SLICE_SIZE"] = slice_size
    cores = (0, 1) if pinned else (None, None)  # P on core 0, D on core 1
    try:
        return run_pd(d_main, (shape, cores[1]), p_main, (shape, reps, budget_s, cores[0]),
                      budget_s + 120)
    finally:
        if saved is None:
            os.environ.pop("MC_TCP_SLICE_SIZE", None)
        else:
            os.environ["MC_TCP_SLICE_SIZE"] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=63, help="blocks moved per transfer")
    ap.add_argument("--p-first", type=int, default=17, help="P's first block id")
    ap.add_argument("--d-first", type=int, default=512, help="D's first block id")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=90, help="stop repeating after this")
    ap.add_argument(
        "--slice",
        action="append",
        default=None,
        help="MC_TCP_SLICE_SIZE values to try; 'default' leaves it unset "
        "(default: default and 1048576)",
    )
    ap.add_argument("--pin", action="store_true", help="pin P to core 0 and D to core 1")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where both KV caches live (cuda needs Mooncake's CUDA build)")
    ap.add_argument("--model", action="append", choices=["all", *CASES],
                    help="model shapes instead (bench/kvcases.py), each against raw Mooncake")
    ap.add_argument("--small", action="store_true",
                    help="--model: each shape cut to 4 layers and 12 blocks (a smoke run: the "
                    "descriptors are still checked byte for byte)")
    ap.add_argument("--auth", choices=["off", "on", "both"],
                    help="instead: a full transfer through a real Sender and Receiver (request, "
                    "write, FINISH), the side channel without CURVE, with it, or both side by "
                    "side (bench/sidechannel.py)")
    ap.add_argument("--verify", choices=["off", "all", "both"],
                    help="instead: the same full transfer with D checking no pull against "
                    "P's digest (verify_kv off), every one (all), or both side by side")
    args = ap.parse_args()
    if args.model:
        report(list(CASES) if "all" in args.model else args.model, args.reps, args.small)
        return
    from rich.console import Console
    from rich.table import Table

    shape = Shape(
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.blocks,
        args.p_first,
        args.d_first,
        args.device,
    )
    if args.auth or args.verify:
        from sidechannel import report as path_report

        path_report(kv_cache, shape, args.reps, "auth" if args.auth else "verify",
                    args.auth or args.verify)
        return
    slices = args.slice or ["default", "1048576"]
    start = time.perf_counter()
    table = Table(
        title=f"KV transfer, {shape.layers} layers x {shape.blocks} blocks = "
        f"{shape.nbytes / MiB:.2f} MiB in {shape.device} memory, Mooncake TCP loopback, "
        "P and D processes"
    )
    for col in (
        "table",
        "MC_TCP_SLICE_SIZE",
        "method",
        "descs/batches",
        "median ms",
        "GB/s",
        "plan ms",
        "ours/raw",
        "ours/memcpy",
        "reps",
    ):
        table.add_column(col, justify="right" if col not in ("table", "method") else "left")
    for i, sl in enumerate(slices):
        # split what is left of the budget between the remaining configurations
        left = args.budget_s - (time.perf_counter() - start)
        budget = max(left / (len(slices) - i), 1)
        res = run_config(shape, args.reps, None if sl == "default" else sl, budget, args.pin)
        for case, r in res.items():
            m = r["median"]
            gbps = {k: shape.nbytes / v / 1e9 for k, v in m.items()}
            for method in ("ours", "raw", "memcpy"):
                is_ours = method == "ours"
                descs = r["descs"] if is_ours else r["raw_descs"] if method == "raw" else 0
                batches = r["batches"] if is_ours else -(-descs // 1024)
                table.add_row(
                    case,
                    sl,
                    method,
                    f"{descs}/{batches}" if method != "memcpy" else "-",
                    f"{m[method] * 1e3:.1f}",
                    f"{gbps[method]:.2f}",
                    f"{r['plan'] * 1e3:.2f}" if is_ours else "",
                    f"{gbps['ours'] / gbps['raw']:.2f}" if is_ours else "",
                    f"{gbps['ours'] / gbps['memcpy']:.2f}" if is_ours else "",
                    str(r["reps"]),
                )
        table.add_section()
    Console(width=160).print(table)
    print(
        f"target: ours/raw >= 0.9 (throughput ratio); run took {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
