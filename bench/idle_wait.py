"""What a D waiting for KV costs its core, and what the connector's idle wait
(`idle_wait_ms`) changes: D's CPU while its requests only wait for KV that P is slow to
send, and the TTFT of requests split P→D, for idle_wait_ms 0 (vLLM's loop alone: it steps
again 1 ms after a step that computed nothing) against the default, in one run (real
vLLM, CPU build, the tiny model, Mooncake TCP on loopback).

    .venv/bin/python bench/idle_wait.py [--waits 0,10] [--sizes 128,1024] [--repeats 8]

Each setup is its own P (CPU 0) and D (CPU 1); they take turns. CPU: `--waiting` requests
sent to D alone, naming a transfer P never computes, so D's engine has nothing to do but
wait; D's processes' CPU seconds over `--seconds` are divided by the wall time (1.0 = one
whole core). TTFT: P and D asked at once (as the proxy's split does), max_tokens 1, so
D's answer time is its first token.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ttft import SERVED, SETTLE_S, Setup, ours_setup  # noqa: E402

from appliance import tinymodel  # noqa: E402
from appliance.proxy.exchange.bodies import decode_body, prefill_body  # noqa: E402
from appliance.proxy.openai_api import COMPLETIONS  # noqa: E402
from tests.e2e.conftest import token_prompt  # noqa: E402

console = Console(stderr=True)


def cpu_seconds(pid: int) -> float:
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def waiting_cpu(setup: Setup, waiting: int, seconds: float) -> float:
    """D's share of a core while `waiting` requests wait for KV that never comes."""
    assert setup.decode_url and setup.bootstrap_url and setup.engine_id
    d_pid = setup.services[2].proc.pid
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(http.post(
            setup.decode_url + COMPLETIONS, json=decode_body(
                {"model": SERVED, "prompt": token_prompt(64, seed=i), "max_tokens": 1},
                f"xfer-never-{uuid.uuid4()}", setup.bootstrap_url, setup.engine_id)))
            for i in range(waiting)]
        await asyncio.sleep(1.0)  # the requests reach the engine and start their pulls
        c0, t0 = cpu_seconds(d_pid), time.monotonic()
        await asyncio.sleep(seconds)
        share = (cpu_seconds(d_pid) - c0) / (time.monotonic() - t0)
        for t in tasks:
            t.cancel()  # the connection closes: D aborts the requests
        await asyncio.gather(*tasks, return_exceptions=True)
    return share


async def split_ttft(setup: Setup, tokens: int, seed: int) -> float:
    assert setup.prefill_url and setup.decode_url and setup.bootstrap_url and setup.engine_id
    body = {"model": SERVED, "prompt": token_prompt(tokens, seed), "max_tokens": 1,
            "temperature": 0}
    xfer = f"xfer-{uuid.uuid4()}"
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        d = asyncio.create_task(http.post(setup.decode_url + COMPLETIONS, json=decode_body(
            body, xfer, setup.bootstrap_url, setup.engine_id)))
        async with http.post(setup.prefill_url + COMPLETIONS,
                             json=prefill_body(body, COMPLETIONS, xfer)) as p:
            await p.read()
        async with await d as r:
            await r.read()
            assert r.status == 200, await r.text()
        return time.monotonic() - started


async def decode_tps(setup: Setup, streams: int, tokens: int, seed: int) -> float:
    """Output tokens per second of `streams` concurrent requests on D alone (no KV to
    wait for): what a shorter spin between vLLM's processes may cost a busy engine."""
    assert setup.decode_url

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        async with http.post(setup.decode_url + COMPLETIONS, json={
                "model": SERVED, "prompt": token_prompt(32, seed + i), "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        await asyncio.gather(*(one(http, i) for i in range(streams)))
        return streams * tokens / (time.monotonic() - started)


async def run(args: argparse.Namespace) -> None:
    model = tinymodel.build(ROOT / ".cache" / "models" / "tiny", "tiny")
    setups = [ours_setup(model, args.log_dir, name=f"wait{w:g}", extra={"idle_wait_ms": w})
              for w in args.waits]
    cpu: dict[str, list[float]] = {s.name: [] for s in setups}
    ttft: dict[tuple[str, int], list[float]] = {}
    tps: dict[str, list[float]] = {s.name: [] for s in setups}
    started: list[Setup] = []
    try:
        for s in setups:
            s.start()
            started.append(s)
        for rnd in range(args.rounds):
            for s in setups if rnd % 2 == 0 else reversed(setups):
                time.sleep(SETTLE_S)
                cpu[s.name].append(await waiting_cpu(s, args.waiting, args.seconds))
                console.log(f"round {rnd + 1} {s.name}: D waiting uses "
                            f"{cpu[s.name][-1]:.0%} of a core")
        for i in range(args.repeats):
            for s in setups if i % 2 == 0 else reversed(setups):
                time.sleep(SETTLE_S)
                tps[s.name].append(await decode_tps(s, 8, 48, seed=50_000 + 100 * i))
            for size in args.sizes:
                for s in setups if i % 2 == 0 else reversed(setups):
                    time.sleep(SETTLE_S)
                    ttft.setdefault((s.name, size), []).append(
                        await split_ttft(s, size, seed=10_000 * size + i))
    finally:
        for s in reversed(started):
            s.stop()
    base = setups[0].name
    table = Table(title=f"D waiting for KV ({args.waiting} requests, {args.seconds:g} s, "
                        f"medians of {args.rounds}) and split TTFT (medians of "
                        f"{args.repeats}); ratios against {base}")
    table.add_column("metric")
    for s in setups:
        table.add_column(s.name, justify="right")
    for s in setups[1:]:
        table.add_column(f"{s.name} / {base}", justify="right")
    rows = {"D's core while waiting": {n: statistics.median(v) for n, v in cpu.items()},
            "decode tokens/s, 8 streams": {n: statistics.median(v) for n, v in tps.items()}}
    for size in args.sizes:
        rows[f"TTFT ms, {size} tokens"] = {
            s.name: statistics.median(ttft[(s.name, size)]) * 1000 for s in setups}
    for label, values in rows.items():
        fmt = "{:.0%}" if "core" in label else "{:.1f}"
        table.add_row(label, *(fmt.format(values[s.name]) for s in setups),
                      *(f"{values[s.name] / values[base]:.2f}" if values[base] else "-"
                        for s in setups[1:]))
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waits", type=lambda v: [float(x) for x in v.split(",")],
                        default=[0.0, 20.0])
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")],
                        default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--waiting", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pd-bench-idle-wait"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
