"""Requests per second of the bootstrap sidecar's /query and /register, concurrency 1 and 64.

The sidecar runs in its own process (as deployed); the load comes from this process over
loopback. Usage: .venv/bin/python bench/bootstrap.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.process import http_ok  # noqa: E402
from tests.conftest import free_port  # noqa: E402


async def load(url: str, method: str, body: bytes | None, concurrency: int,
               seconds: float) -> tuple[float, float, float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def worker() -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                async with http.request(method, url, data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    return len(latencies) / elapsed, statistics.median(latencies) * 1e3, p99 * 1e3


async def run(base: str, seconds: float) -> list[tuple]:
    rows = []
    # A realistic registry: 8 dp ranks x 8 tp ranks.
    async with aiohttp.ClientSession() as http:
        for dp in range(8):
            for tp in range(8):
                reg = {"engine_id": f"engine-{dp}", "dp_rank": dp, "tp_rank": tp,
                       "addr": f"tcp://10.0.0.{dp}:{40000 + tp}"}
                async with http.post(base + "/register", json=reg) as r:
                    assert r.status == 200
    refresh = json.dumps({"engine_id": "engine-0", "dp_rank": 0, "tp_rank": 0,
                          "addr": "tcp://10.0.0.0:40000"}).encode()
    for name, method, body in (("GET /query", "GET", None), ("POST /register", "POST", refresh)):
        path = "/query" if method == "GET" else "/register"
        for conc in (1, 64):
            rps, p50, p99 = await load(base + path, method, body, conc, seconds)
            rows.append((name, conc, rps, p50, p99))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "appliance.bootstrap", "--host",
                               "127.0.0.1", "--port", str(port), "--no-token",
                               "--log-level", "WARNING"])
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            if http_ok(base + "/health"):
                break
            time.sleep(0.1)
        rows = asyncio.run(run(base, args.seconds))
    finally:
        server.terminate()
        server.wait(10)
    table = Table(title="bootstrap sidecar (8 engines x 8 workers registered)")
    for col in ("request", "concurrency", "req/s", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right")
    for name, conc, rps, p50, p99 in rows:
        table.add_row(name, str(conc), f"{rps:,.0f}", f"{p50:.2f}", f"{p99:.2f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
