"""The model shapes of `bench/transfer.py --model`: MLA latents, sliding-window groups and
P/D of different TP, each moved by our planner + transport and, in the same run, by a raw
Mooncake batch write of descriptors written out by hand from the known layout.

- gqa:     docs/protocol.md's Qwen3-8B (36 layers, 8 KV heads x 128, block 16), for reference
- mla:     DeepSeek-V3's latent (61 layers, one 576-wide latent, block 64 as FlashMLA's)
- sliding: gpt-oss-120b (36 layers, 8 KV heads x 64, every other layer a 128-token window):
           full layers move every block, window layers only the window's last blocks
- tp1-2:   P TP=1 -> D TP=2, what decode rank 1 pulls: heads 4..7 of each P block
- tp2-1:   P TP=2 -> D TP=1, what prefill rank 1 writes: its 4 heads into heads 4..7 of D's
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from appliance.connector.planning.groups import window_blocks
from appliance.connector.planning.tpplan import Pull


@dataclass(frozen=True)
class Case:
    title: str
    layers: int
    p_heads: int
    d_heads: int
    head_dim: int  # per head and per K or V (an MLA latent counts as K|V of 288)
    block: int
    blocks: int = 63  # prompt blocks
    window: int = 0  # tokens of the sliding window of odd layers (0: none)
    pull: Pull | None = None  # the head slice moved (None: whole blocks)
    p_first: int = 17
    d_first: int = 512

    def chunk(self, heads: int) -> int:
        return 2 * heads * self.block * self.head_dim * 2  # K and V, bf16

    @property
    def window_blocks(self) -> int:
        return window_blocks(self.window, self.block) if self.window else 0

    def group(self, layer: int) -> int:
        return layer % 2 if self.window else 0

    def moved(self, layer: int) -> int:
        """Blocks layer `layer` moves."""
        return min(self.blocks, self.window_blocks) if self.group(layer) else self.blocks

    @property
    def heads_moved(self) -> int:
        return self.pull.heads if self.pull else self.d_heads

    @property
    def nbytes(self) -> int:
        head = self.chunk(1)
        return sum(self.moved(li) for li in range(self.layers)) * head * self.heads_moved


CASES = {
    "gqa": Case("gqa: Qwen3-8B, 36 layers x 8 KV heads", 36, 8, 8, 128, 16),
    "mla": Case("mla: DeepSeek-V3 latent, 61 layers x 576", 61, 1, 1, 288, 64, blocks=16),
    "sliding": Case("sliding: gpt-oss-120b, 18 of 36 layers a 128-token window", 36, 8, 8, 64,
                    16, window=128),
    "tp1-2": Case("tp1-2: P TP=1 -> D TP=2, decode rank 1's heads", 36, 8, 4, 128, 16,
                  pull=Pull(0, p_offset=4, d_offset=0, heads=4)),
    "tp2-1": Case("tp2-1: P TP=2 -> D TP=1, prefill rank 1's heads", 36, 4, 8, 128, 16,
                  pull=Pull(1, p_offset=0, d_offset=4, heads=4)),
}


def cache(case: Case, heads: int, num_blocks: int, fill: bool) -> tuple[Any, dict[str, Any]]:
    """vLLM's CPU pages, one buffer: per layer [blocks, heads, block, 2*head_dim]."""
    import torch

    buf = torch.zeros(case.layers * num_blocks * case.chunk(heads), dtype=torch.uint8)
    if fill:
        buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    views = {f"model.layers.{li}.attn": c.view(torch.bfloat16).view(
        num_blocks, heads, case.block, 2 * case.head_dim)
        for li, c in enumerate(buf.chunk(case.layers))}
    return buf, views


def regions(case: Case, views: dict[str, Any], num_blocks: int, heads: int) -> list[Any]:
    from appliance.connector.worker import kv_regions

    groups = {f"model.layers.{li}.attn": case.group(li) for li in range(case.layers)}
    return kv_regions(views, num_blocks, groups, heads)[0]


def d_main(conn: Connection, case: Case) -> None:
    from appliance.connector.planning.plan import TensorInfo, registration_spans
    from appliance.connector.transfers.mooncake import MooncakeTransport

    transport = MooncakeTransport()
    session = transport.start("127.0.0.1", "tcp")
    n = case.d_first + case.blocks
    _buf, views = cache(case, case.d_heads, n, fill=False)
    transport.register(registration_spans([TensorInfo.from_tensor(v) for v in views.values()]))
    conn.send((session, regions(case, views, n, case.d_heads)))
    conn.recv()
    transport.close()


def ids(case: Case) -> tuple[list[list[int]], list[list[int]]]:
    """Per KV-cache group, P's and D's blocks that move (KVGroup.needed's rule)."""
    src = list(range(case.p_first, case.p_first + case.blocks))
    dst = list(range(case.d_first, case.d_first + case.blocks))
    if not case.window:
        return [src], [dst]
    w = case.window_blocks
    return [src, src[-w:]], [dst, dst[-w:]]


def ours(case: Case, p_regions: list[Any], d_regions: list[Any]) -> Any:
    from appliance.connector.planning.descriptors import build_group_descriptors
    from appliance.connector.planning.tpplan import narrow

    src, dst = (narrow(p_regions, d_regions, case.pull) if case.pull
                else (p_regions, d_regions))
    s_ids, d_ids = ids(case)
    return build_group_descriptors(src, dst, s_ids, d_ids)


def by_hand(case: Case, p_base: int, d_base: int) -> list[tuple[int, int, int]]:
    """The same bytes from the layout alone: layer li of P starts li * its layer size in,
    block b at b * its block size, head h at h * one head's bytes."""
    p_chunk, d_chunk, head = case.chunk(case.p_heads), case.chunk(case.d_heads), case.chunk(1)
    p_layer = (case.p_first + case.blocks) * p_chunk
    d_layer = (case.d_first + case.blocks) * d_chunk
    p_off = case.pull.p_offset * head if case.pull else 0
    d_off = case.pull.d_offset * head if case.pull else 0
    n = head * case.heads_moved
    out = []
    for li in range(case.layers):
        k = case.moved(li)
        first = case.blocks - k
        ps, ds = p_base + li * p_layer + p_off, d_base + li * d_layer + d_off
        if n == p_chunk == d_chunk:  # whole blocks, both sides contiguous: one run
            out.append((ps + (case.p_first + first) * p_chunk,
                        ds + (case.d_first + first) * d_chunk, k * n))
            continue
        out += [(ps + (case.p_first + b) * p_chunk, ds + (case.d_first + b) * d_chunk, n)
                for b in range(first, case.blocks)]
    return out


def p_main(conn: Connection, case: Case, reps: int) -> None:
    from mooncake.engine import TransferEngine

    from appliance.connector.planning.descriptors import split_batches
    from appliance.connector.planning.plan import TensorInfo, registration_spans
    from appliance.connector.transfers.mooncake import MooncakeTransport

    d_session, d_regions = conn.recv()
    transport = MooncakeTransport()
    transport.start("127.0.0.1", "tcp")
    n = case.p_first + case.blocks
    _buf, views = cache(case, case.p_heads, n, fill=True)
    spans = registration_spans([TensorInfo.from_tensor(v) for v in views.values()])
    transport.register(spans)
    raw = TransferEngine()
    assert raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert raw.batch_register_memory([a for a, _ in spans], [b for _, b in spans]) == 0
    p_regions = regions(case, views, n, case.p_heads)
    hand = by_hand(case, p_regions[0].base_addr, d_regions[0].base_addr)
    descs = ours(case, p_regions, d_regions)
    assert sorted(zip(descs.srcs, descs.dsts, descs.lengths, strict=True)) == sorted(hand)
    assert descs.total_bytes == case.nbytes
    batches = [tuple(map(list, zip(*hand[i:i + 1024], strict=True)))
               for i in range(0, len(hand), 1024)]

    def run_ours() -> None:
        t = time.perf_counter()
        d = ours(case, p_regions, d_regions)
        plan_s.append(time.perf_counter() - t)
        transport.write(d_session, d)

    def run_raw() -> None:
        for s, d, lens in batches:
            assert raw.batch_transfer_sync_write(d_session, s, d, lens) == 0

    plan_s: list[float] = []
    run_ours()
    run_raw()  # warm-up: handshakes, page faults
    plan_s.clear()
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for rep in range(reps):  # alternate the order: drift hits both alike
        for name, fn in ((("ours", run_ours), ("raw", run_raw)) if rep % 2 == 0
                         else (("raw", run_raw), ("ours", run_ours))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    conn.send({"median": {k: statistics.median(v) for k, v in times.items()},
               "plan": statistics.median(plan_s), "descs": len(descs),
               "batches": len(split_batches(descs)), "raw_descs": len(hand), "reps": reps})
    transport.close()


def run_pd(d_target: Any, d_args: tuple, p_target: Any, p_args: tuple,
           p_timeout: float) -> Any:
    """D and P in processes of their own: D publishes (session, regions), P gets them,
    measures and sends its result back; both are stopped whatever happens."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    d_conn, d_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    d = ctx.Process(target=d_target, args=(d_child, *d_args), daemon=True)
    p = ctx.Process(target=p_target, args=(p_child, *p_args), daemon=True)
    try:
        d.start()
        p.start()
        if not d_conn.poll(60):
            raise SystemExit("D did not start")
        p_conn.send(d_conn.recv())
        if not p_conn.poll(p_timeout):
            raise SystemExit("P did not finish")
        return p_conn.recv()
    finally:
        d_conn.send("exit")
        for proc in (p, d):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def run_case(case: Case, reps: int) -> dict:
    return run_pd(d_main, (case,), p_main, (case, reps), 300)


def report(names: list[str], reps: int, small: bool = False) -> None:
    """Run each case (fresh P and D processes) and print one table; `small`: each cut to 4
    layers and 12 blocks (more than a sliding window's 8)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KV transfer by model shape, Mooncake TCP loopback, P and D processes")
    for col in ("case", "MiB", "descs/batches", "ours ms", "raw ms", "GB/s", "plan ms",
                "ours/raw", "reps"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name in names:
        case = CASES[name]
        if small:
            case = replace(case, layers=min(case.layers, 4), blocks=min(case.blocks, 12))
        r = run_case(case, reps)
        m = r["median"]
        table.add_row(case.title, f"{case.nbytes / (1 << 20):.1f}",
                      f"{r['descs']}/{r['batches']}", f"{m['ours'] * 1e3:.1f}",
                      f"{m['raw'] * 1e3:.1f}", f"{case.nbytes / m['ours'] / 1e9:.2f}",
                      f"{r['plan'] * 1e3:.2f}", f"{m['raw'] / m['ours']:.2f}", str(r["reps"]))
    Console(width=160).print(table)
    print("ours/raw: raw time over ours (throughput ratio); target >= 0.9")
