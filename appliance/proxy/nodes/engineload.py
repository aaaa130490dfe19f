"""What each engine runs and queues beyond this proxy's own requests, from the engine's own
/metrics (vLLM's scheduler gauges), so that `auto` weighs work other proxies sent to the
same engines (the chart runs two) or clients sent them directly.

The proxy knows its own requests exactly (Backend.in_flight, its placement tickets); the
engine knows all of them. What the engine holds beyond the proxy's in-flight count is
someone else's: its waiting part counts as prefills queued there, its running part as
decodes there (appliance.proxy.placement.decision). The gauges are read every
`engine_load_interval_s`, and each reading stands alone: another proxy's rising load shows
at the next reading. The engine renders its gauges at some moment during the read, so this
proxy's own count is the larger of its counts when the read began and when it ended: one of
its requests that ended (or began) meanwhile is not taken for another proxy's. (This once
took the smaller of two readings, which saw each rise a reading late; measured on
bench/goodput.py's two-proxy setup, either way placed 17% of requests on P alone where one
proxy placed a third: the gauges' lag is not what keeps the two apart.)
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from appliance.proxy.nodes.backends import Backend, Backends
from appliance.proxy.nodes.background import Background

log = logging.getLogger("appliance.proxy.nodes.engineload")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


def engine_counts(text: str) -> tuple[int, int] | None:
    """(running, waiting) summed over the engine's series (one per engine of a data-parallel
    server); None when the text has neither gauge. Two names among some hundred lines: a
    scan, not a full exposition parse, since it runs every interval for every node."""
    sums = {RUNNING: 0.0, WAITING: 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in sums:
            continue
        try:  # vLLM writes no timestamp: the value is the line's last field
            sums[name] += float(line.rsplit(None, 1)[1])
        except (ValueError, IndexError):
            continue
        seen = True
    return (round(sums[RUNNING]), round(sums[WAITING])) if seen else None


KV_LOADS = "vllm:num_requests_kv_fetch_by_stage"
UNFINISHED = ('stage="waiting_to_start"', 'stage="in_progress"')


def kv_loads(text: str) -> int | None:
    """A decode engine's requests whose KV load has not finished (waiting to start or in
    progress); None when it does not export the gauge."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(KV_LOADS) and any(stage in line for stage in UNFINISHED):
            try:
                total += float(line.rsplit(None, 1)[1])
                seen = True
            except (ValueError, IndexError):
                continue
    return round(total) if seen else None


def others(running: int, waiting: int, own: int) -> tuple[int, int]:
    """(waiting, running) of the requests the engine holds beyond `own` (this proxy's in
    flight there). Its own may be waiting as well as running, so the others' waiting part
    is at most the engine's waiting count."""
    extra = max(0, running + waiting - own)
    queued = min(extra, waiting)
    return queued, extra - queued


class LoadPoller(Background):
    """Every interval, each healthy node's /metrics: Backend.others_* (written here only)."""

    task_name = "proxy-engine-load"

    def __init__(self, backends: Backends, session: aiohttp.ClientSession,
                 headers: dict[str, str], interval_s: float, timeout_s: float) -> None:
        self.backends = backends
        self.session = session
        self.headers = headers
        self.interval = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        Background.__init__(self)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def poll_once(self) -> None:
        nodes = [b for b in self.backends.all() if b.healthy]
        await asyncio.gather(*(self._read(b) for b in nodes))

    async def _read(self, b: Backend) -> None:
        own_before = b.in_flight
        try:
            async with self.session.get(f"{b.url}/metrics", headers=self.headers,
                                        timeout=self.timeout) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
            log.debug("%s %s: no load reading: %s", b.role, b.url, exc)
            text = ""
        counts = engine_counts(text)
        if counts is None:  # nothing known: count nothing, as before the first reading
            b.others_waiting = b.others_running = 0
            return
        b.others_waiting, b.others_running = others(*counts, max(own_before, b.in_flight))
