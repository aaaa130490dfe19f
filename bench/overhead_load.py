"""bench/proxy_overhead.py's load generator: a small keep-alive HTTP/1.1 client on raw
asyncio sockets (cheap, so that the server measured is the limit), its results, and the
alternating slices that compare two servers under the same load."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overhead_servers import CHUNKS

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


class HttpConn(asyncio.Protocol):
    """One keep-alive connection; request() resolves when the whole response is in."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        parsed = _parse_response(self.buf)
        if parsed is not None and self.done is not None and not self.done.done():
            status, body, used = parsed
            del self.buf[:used]
            self.done.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.done


def _parse_response(buf: bytearray) -> tuple[int, bytes, int] | None:
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in head[1:])}
    pos = end + 4
    if "content-length" in headers:
        n = int(headers["content-length"])
        if len(buf) < pos + n:
            return None
        return status, bytes(buf[pos:pos + n]), pos + n
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
            if len(buf) < line_end + 2 + size + 2:
                return None
            body += buf[line_end + 2:line_end + 2 + size]
            pos = line_end + 2 + size + 2
            if size == 0:
                return status, bytes(body), pos
    raise RuntimeError(f"cannot frame response: {head[0]}")


# Ports whose server wants a client key (the keyed proxy of --auth).
CLIENT_KEY = "bench-client-key"
KEYED_PORTS: set[int] = set()


def _request_bytes(port: int, stream: bool) -> bytes:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": CHUNKS,
                       "temperature": 0, "stream": stream}).encode()
    auth = f"Authorization: Bearer {CLIENT_KEY}\r\n" if port in KEYED_PORTS else ""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


@dataclass
class Result:
    latencies: list[float]
    seconds: float
    total: int = 0  # requests, warm-up included
    cpu_per_req: float | None = None  # seconds of the measured server's CPU per request
    busy: float | None = None  # how busy the watched cores were (the ones not the proxy's)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _connect(port: int, n: int) -> list[HttpConn]:
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(n):
        _, proto = await loop.create_connection(HttpConn, "127.0.0.1", port)
        conns.append(proto)
    return conns


async def load(port: int, concurrency: int, seconds: float, stream: bool,
               warmup: float = 0.5) -> Result:
    raw = _request_bytes(port, stream)
    conns = await _connect(port, concurrency)
    latencies: list[float] = []
    total = 0
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds

    async def worker(conn: HttpConn) -> None:
        nonlocal total
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            status, body = await conn.request(raw)
            t1 = time.perf_counter()
            total += 1
            if status != 200 or (stream and not body.endswith(b"data: [DONE]\n\n")):
                raise RuntimeError(f"bad answer {status}: {body[:200]!r}")
            if t0 >= measure_from:
                latencies.append(t1 - t0)

    # Bounded: a stuck server fails the run instead of hanging it.
    await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns)), warmup + seconds + 30)
    elapsed = time.perf_counter() - measure_from
    for c in conns:
        assert c.transport is not None
        c.transport.close()
    return Result(latencies, elapsed, total)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_times(cpus: set[int]) -> tuple[int, int]:
    """(all, idle) clock ticks of these cores so far (/proc/stat; idle counts iowait)."""
    total = idle = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(v) for v in fields]
                total += sum(ticks)
                idle += ticks[3] + ticks[4]
    return total, idle


def _busy_since(watch: set[int], before: tuple[int, int]) -> float:
    """How busy these cores were since `before` (_cpu_times then)."""
    total, idle = _cpu_times(watch)
    return 1 - (idle - before[1]) / max(1, total - before[0])


def measure(port: int, pid: int, concurrency: int, seconds: float, stream: bool,
            warmup: float, watch: set[int] | None = None) -> Result:
    before = cpu_seconds(pid)
    cores = _cpu_times(watch) if watch else None
    result = asyncio.run(load(port, concurrency, seconds, stream, warmup))
    result.cpu_per_req = (cpu_seconds(pid) - before) / max(1, result.total)
    if watch and cores is not None:
        result.busy = _busy_since(watch, cores)
    return result


def compare(d: tuple[int, int], x: tuple[int, int], concurrency: int, seconds: float,
            stream: bool, rounds: int, watch: set[int] | None = None) -> tuple[Result, Result]:
    """Direct and proxied in alternating slices, so that other work on a shared machine
    weighs on both sides alike; the slices are pooled. `watch`: cores whose load is kept
    (Result.busy), the ones the servers measured do not run on."""
    pooled = [Result([], 0.0, 0, 0.0), Result([], 0.0, 0, 0.0)]
    for i in range(rounds):
        for (port, pid), acc in zip((d, x), pooled, strict=True):
            r = measure(port, pid, concurrency, seconds / rounds, stream,
                        warmup=0.3 if i == 0 else 0.05, watch=watch)
            acc.latencies += r.latencies
            acc.seconds += r.seconds
            acc.total += r.total
            acc.cpu_per_req = (acc.cpu_per_req or 0) + (r.cpu_per_req or 0) * r.total
            if r.busy is not None:
                acc.busy = (acc.busy or 0) + r.busy * r.seconds
    for acc in pooled:
        acc.cpu_per_req = (acc.cpu_per_req or 0) / max(1, acc.total)
        if acc.busy is not None:
            acc.busy /= max(1e-9, acc.seconds)
    return pooled[0], pooled[1]


def _run_ns(pid: int) -> int:
    """CPU time of all of a process's threads, in ns (schedstat: exact, where /proc's stat
    counts clock ticks of 10 ms, too coarse for a fraction of a second)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass  # a thread that just ended
    return total


@dataclass
class Switched:
    """One server measured two ways in windows of one unbroken load: each side's windows
    pooled, and the paired windows' req/s ratios (side 1 over side 0), whose median shrugs
    off a neighbour's burst that one window caught."""

    sides: tuple[Result, Result]
    rps_ratios: list[float]

    @property
    def rps_ratio(self) -> float:
        return statistics.median(self.rps_ratios)


async def _switched(port: int, pid: int, switch: Callable[[int], None], concurrency: int,
                    seconds: float, stream: bool, window: float, settle: float,
                    watch: set[int] | None) -> Switched:
    raw = _request_bytes(port, stream)
    conns = await _connect(port, concurrency)
    # The window open now: its start, the latencies of requests begun in it, completions.
    current: list = [0.0, [], 0]
    stop = False

    async def worker(conn: HttpConn) -> None:
        while not stop:
            t0 = time.perf_counter()
            status, body = await conn.request(raw)
            t1 = time.perf_counter()
            if status != 200 or (stream and not body.endswith(b"data: [DONE]\n\n")):
                raise RuntimeError(f"bad answer {status}: {body[:200]!r}")
            current[2] += 1
            if t0 >= current[0]:  # begun before the window: its latency not counted
                current[1].append(t1 - t0)

    workers = asyncio.gather(*(worker(c) for c in conns))
    sides = (Result([], 0.0, 0, 0.0), Result([], 0.0, 0, 0.0))
    per_window: list[tuple[int, float]] = []  # side, req/s
    try:
        switch(0)
        await asyncio.sleep(0.3)  # warm-up
        # Each pair's order drawn at random and each window's length jittered: a fixed
        # order locks onto the proxy's periodic work (health checks each second, timers)
        # and read 6% apart with both sides the same.
        order = [side for _ in range(max(1, round(seconds / window) // 2))
                 for side in random.sample((0, 1), 2)]
        for side in order:
            switch(side)
            # Requests begun before the switch end first: their work is the other side's.
            await asyncio.sleep(settle)
            cores = _cpu_times(watch) if watch else None
            cpu0, t_start = _run_ns(pid), time.perf_counter()
            current[:] = [t_start, [], 0]
            await asyncio.sleep(window * random.uniform(0.7, 1.3))
            if workers.done():
                workers.result()  # a worker failed: its error
            elapsed = time.perf_counter() - t_start
            cpu = (_run_ns(pid) - cpu0) / 1e9
            done, acc = current[2], sides[side]
            acc.latencies += current[1]
            acc.seconds += elapsed
            acc.total += done
            acc.cpu_per_req = (acc.cpu_per_req or 0) + cpu
            if watch and cores is not None:
                acc.busy = (acc.busy or 0) + _busy_since(watch, cores) * elapsed
            per_window.append((side, done / elapsed))
    finally:
        stop = True
        await asyncio.wait_for(workers, 30)  # bounded: each worker ends after its request
        for c in conns:
            assert c.transport is not None
            c.transport.close()
    for acc in sides:
        acc.cpu_per_req = (acc.cpu_per_req or 0) / max(1, acc.total)
        if acc.busy is not None:
            acc.busy /= max(1e-9, acc.seconds)
    rps = []
    for a, b in zip(per_window[::2], per_window[1::2], strict=True):
        off, on = (a, b) if a[0] == 0 else (b, a)
        rps.append(on[1] / off[1])
    return Switched(sides, rps)


def compare_switched(port: int, pid: int, switch: Callable[[int], None], concurrency: int,
                     seconds: float, stream: bool, window: float = 0.1, settle: float = 0.05,
                     watch: set[int] | None = None) -> Switched:
    """One server, switched between two ways (`switch(side)`) under one unbroken load,
    measured in windows of about `window` seconds, each `settle` seconds after its switch:
    no reconnects, no second process whose own speed differs (two identical proxy
    processes read up to 4% apart on a shared machine; two sides the same read within 1-2%
    this way, in 0.1 s windows)."""
    return asyncio.run(_switched(port, pid, switch, concurrency, seconds, stream, window,
                                 settle, watch))
