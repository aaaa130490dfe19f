"""bench/soak.py's faults, and what it reads off the node: counters that survive restarts,
the proxy's memory, KV blocks held once idle.

Each fault acts on one part of a LocalNode by its process group (never by name) and ends
once the node is whole again: the part restarted and back in the proxy's rotation, and a
probe request answered exactly. Its recovery time runs from the fault to that probe.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from churn import COMPUTED, Counter

from appliance.pdctl.node.status import metric_samples
from appliance.process import ServiceProcess

FAULTS = ("d_killed", "p_killed", "p_frozen", "link_reset", "proxy_restarted")
FROZEN_S = 10.0
PROXY_RSS_BEFORE_RESTART: list[int] = []  # KiB, as each proxy_restarted found it
RECOVERY_LIMIT_S = 300.0

# What the soak counts, from which part: (role, series, label filter).
SERIES = {
    "continued elsewhere (proxy migrations)": ("proxy", "pd_proxy_migrations_total", {}),
    "pulls received by D": ("decode", "vllm:pd_kv_received_total", {}),
    "pulls recomputed on D": ("decode", "vllm:pd_kv_failed_receives_total", {}),
    "KV digest mismatches on D": ("decode", "vllm:pd_kv_digest_mismatches_total", {}),
    "prompt tokens computed on P": ("prefill", COMPUTED, {}),
    "prompt tokens computed on D": ("decode", COMPUTED, {}),
}


def _url(node: Any, role: str) -> str:
    return {"proxy": node.spec.proxy_url, "prefill": node.spec.prefill_url,
            "decode": node.spec.decode_url}[role]


class Counters:
    """Running totals of SERIES, followed across restarts (churn.Counter)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._counters = {key: Counter() for key in SERIES}

    @property
    def totals(self) -> dict[str, float]:
        return {key: c.total for key, c in self._counters.items()}

    def poll(self) -> None:
        by_role: dict[str, list] = {}
        for key, (role, name, labels) in SERIES.items():
            if role not in by_role:
                try:
                    by_role[role] = _samples(self.node, role)
                except OSError:
                    by_role[role] = []  # down or restarting: read it next time
                    continue
            samples = by_role[role]
            if not samples:
                continue
            self._counters[key].update(sum(
                v for n, got, v in samples
                if n == name and all(got.get(k) == want for k, want in labels.items())))

    async def every(self, seconds: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.poll)
            try:
                await asyncio.wait_for(stop.wait(), seconds)
            except asyncio.TimeoutError:
                pass


def rss_kib(svc: ServiceProcess | None) -> int:
    if svc is None or svc.proc is None:
        return 0
    with open(f"/proc/{svc.proc.pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


async def blocks_held_when_idle(node: Any, within: float) -> tuple[float, float]:
    """P's and D's KV usage once both are idle, or as it stands after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        usage = tuple(_usage(node, role) for role in ("prefill", "decode"))
        if usage == (0.0, 0.0) or time.monotonic() > deadline:
            return usage  # type: ignore[return-value]
        await asyncio.sleep(1.0)


def _samples(node: Any, role: str) -> list[tuple[str, dict[str, str], float]]:
    """`role`'s /metrics (P and D need the node's key; the proxy's is open)."""
    req = urllib.request.Request(_url(node, role) + "/metrics",
                                 headers={} if role == "proxy" else node.auth_headers(role))
    with urllib.request.urlopen(req, timeout=5) as r:
        return metric_samples(r.read().decode())


def _usage(node: Any, role: str) -> float:
    return max(v for n, _, v in _samples(node, role) if n == "vllm:kv_cache_usage_perc")


# One request through the proxy, answered exactly or not (the load's own check).
Probe = Callable[[aiohttp.ClientSession], Awaitable[bool]]


@dataclass
class Record:
    name: str
    at: float
    recovery_s: float | None = None
    note: str = ""


@dataclass
class Fault:
    name: str
    act: Callable[[Any], Awaitable[str]]  # returns the role to see back in rotation, or ""

    async def run(self, node: Any, probe: Probe) -> Record:
        began = time.monotonic()
        record = Record(self.name, began)
        try:
            role = await self.act(node)
            await _whole(node, role, probe, began + RECOVERY_LIMIT_S)
            record.recovery_s = round(time.monotonic() - began, 2)
        except (TimeoutError, OSError, RuntimeError) as exc:
            record.note = str(exc)[:200]
        return record


def _kill(svc: ServiceProcess) -> None:
    assert svc.proc is not None
    os.killpg(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(30)


async def _restart(svc: ServiceProcess) -> None:
    svc.start()
    await asyncio.to_thread(svc.wait_healthy, RECOVERY_LIMIT_S)


async def _d_killed(node: Any) -> str:
    _kill(node.decode)
    await _restart(node.decode)
    return "decode"


async def _p_killed(node: Any) -> str:
    _kill(node.prefill)
    await _restart(node.prefill)
    return "prefill"


async def _p_frozen(node: Any) -> str:
    os.killpg(node.prefill.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FROZEN_S)
    finally:
        os.killpg(node.prefill.proc.pid, signal.SIGCONT)
    return "prefill"


async def _link_reset(node: Any) -> str:
    """Every TCP connection to P's side channels (its registered ROUTER ports) reset."""
    for port in _side_channel_ports(node):
        for side in ("dport", "sport"):  # D's end and P's end of each connection
            subprocess.run(["ss", "-K", "dst" if side == "dport" else "src", "127.0.0.1",
                            side, "=", f":{port}"], capture_output=True, check=False)
    return ""


def _side_channel_ports(node: Any) -> list[int]:
    req = urllib.request.Request(f"{node.spec.bootstrap_url}/query",
                                 headers=node.auth_headers("bootstrap"))
    with urllib.request.urlopen(req, timeout=5) as r:
        answer = json.load(r)
    addrs = [addr for engine in answer.values()
             for ranks in engine.get("worker_addr", {}).values() for addr in ranks.values()]
    if not addrs:
        raise RuntimeError("P registered no side channel")
    return [int(a.rsplit(":", 1)[1]) for a in addrs]


async def _proxy_restarted(node: Any) -> str:
    PROXY_RSS_BEFORE_RESTART.append(rss_kib(node.proxy))  # its growth until then
    node.proxy.stop()  # SIGTERM: the proxy drains (--drain-grace), then exits
    await _restart(node.proxy)
    return "proxy"


def schedule(names: list[str]) -> list[Fault]:
    acts = {"d_killed": _d_killed, "p_killed": _p_killed, "p_frozen": _p_frozen,
            "link_reset": _link_reset, "proxy_restarted": _proxy_restarted}
    return [Fault(name, acts[name]) for name in names]


async def _whole(node: Any, role: str, probe: Probe, deadline: float) -> None:
    """Until the part is back in the proxy's rotation and a probe is answered exactly."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not whole after {RECOVERY_LIMIT_S:.0f} s")
            try:
                if await _in_rotation(http, node, role) and await probe(http):
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)


async def _in_rotation(http: aiohttp.ClientSession, node: Any, role: str) -> bool:
    if role in ("", "proxy"):
        return True
    async with http.get(node.spec.proxy_url + "/status") as r:
        status = await r.json()
    return all(b["in_rotation"] for b in status[role])
