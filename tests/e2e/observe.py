"""What the e2e tests read off a running node: Prometheus series of vLLM and of the proxy,
whether nodes are in the proxy's rotation, whether blocks are held, whether D really used
P's KV for a request."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp

from appliance.pdctl.node.status import metric_samples
from tests.e2e.conftest import ask


def _samples(base: str) -> list[tuple[str, dict[str, str], float]]:
    return metric_samples(urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())


def metric(base: str, series: str) -> float:
    """The sum of a series at `base`/metrics: a family name sums over its labels, a name
    with labels (`x_total{reason="y"}`) is that one series; absent is 0."""
    name, _, labels = series.partition("{")
    match = dict(part.split("=", 1) for part in labels.rstrip("}").split(",") if part)
    return sum(v for n, got, v in _samples(base) if n == name
               and all(got.get(k) == want.strip('"') for k, want in match.items()))


def remote_decisions(proxy: str) -> float:
    """Requests the proxy at `proxy` placed remote (P prefills, D pulls its KV)."""
    return metric(proxy, 'pd_proxy_split_decisions_total{decision="remote"}')


def calibrated(proxy: str, within_s: float = 120.0) -> dict:
    """The proxy's split status once auto's start-up calibration (prefills on P, each
    pulled by D) has timed the handoff, or as it stands after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        with urllib.request.urlopen(proxy + "/status", timeout=10) as r:
            split = json.loads(r.read())["split"]
        if split["handoff"]["samples"] or time.monotonic() > deadline:
            return split
        time.sleep(0.5)


def received_for_each_remote(decode: str, before: float, remote: float,
                             within_s: float = 10.0) -> None:
    """Until D's vllm:pd_kv_received_total has grown by `remote` since `before`: D
    recomputes what it does not receive (kv_load_failure_policy), so exact output alone
    does not show the KV moved. D's stats reach /metrics with its next step."""
    deadline = time.monotonic() + within_s
    while (got := metric(decode, "vllm:pd_kv_received_total") - before) < remote:
        assert time.monotonic() < deadline, f"D received P's KV {got} times, {remote} remote"
        time.sleep(0.2)
    assert got == remote, f"D received P's KV {got} times, {remote} remote"


def kv_usage(base: str) -> float:
    values = [v for n, _, v in _samples(base) if n == "vllm:kv_cache_usage_perc"]
    assert values, "vllm:kv_cache_usage_perc not exported"
    return max(values)


async def wait_no_blocks_held(node, within: float = 30) -> None:
    """Until neither P nor D holds a KV block; fails after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        usage = (kv_usage(node.spec.prefill_url), kv_usage(node.spec.decode_url))
        if usage == (0.0, 0.0):
            return
        assert time.monotonic() < deadline, f"blocks still held: P, D usage = {usage}"
        await asyncio.sleep(0.2)


async def in_rotation(node, role: str, within: float = 30, proxy: str | None = None) -> None:
    """Until every `role` node is in the rotation of the node's proxy (or `proxy`'s)."""
    deadline = time.monotonic() + within
    while True:
        async with aiohttp.ClientSession() as http:
            async with http.get((proxy or node.spec.proxy_url) + "/status") as r:
                status = await r.json()
        if all(b["in_rotation"] for b in status[role]):
            return
        assert time.monotonic() < deadline, f"{role} not back in rotation: {status}"
        await asyncio.sleep(0.3)


async def prefills_answered(node, n: float, within: float = 60) -> None:
    """Until the proxy has had n prefill answers in all (the transfers then under way)."""
    deadline = time.monotonic() + within
    while metric(node.spec.proxy_url, "pd_proxy_prefill_seconds_count") < n:
        assert time.monotonic() < deadline, "P did not answer in time"
        await asyncio.sleep(0.05)


async def timed_ask(url: str, body: dict) -> tuple[int, str, float]:
    """(status, text or error body, seconds) of one completion (conftest.ask)."""
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        status, text = await ask(http, url, body)
    return status, text, time.monotonic() - started


async def served_from_p(node, body: dict, want: str, bound_s: float = 15) -> float:
    """The proxy split it (no fallback of any reason) and D received P's KV for it (no
    recompute, no stale peer), with a plain server's output, within `bound_s`; returns
    the seconds it took."""
    fallbacks = metric(node.spec.proxy_url, "pd_proxy_prefill_fallbacks_total")
    received = metric(node.spec.decode_url, "vllm:pd_kv_received_total")
    status, text, took = await timed_ask(node.spec.proxy_url, body)
    assert (status, text) == (200, want)
    assert took < bound_s
    assert metric(node.spec.proxy_url, "pd_proxy_prefill_fallbacks_total") == fallbacks
    deadline = time.monotonic() + 10  # D's stats reach /metrics with its next step
    while metric(node.spec.decode_url, "vllm:pd_kv_received_total") <= received:
        assert time.monotonic() < deadline, "D did not receive P's KV"
        await asyncio.sleep(0.2)
    return took


async def stream_load(url: str, stop: asyncio.Event, limit: int = 400) -> int:
    """Four clients streaming completions through `url` until `stop` (at most `limit`
    requests in all); the requests sent."""
    sent = 0

    async def client(http: aiohttp.ClientSession, k: int) -> None:
        nonlocal sent
        while not stop.is_set() and sent < limit:
            sent += 1
            status, _ = await ask(http, url, {"model": "tiny", "prompt": f"load {k} {sent}",
                                              "max_tokens": 12, "stream": True})
            assert status == 200

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http, k) for k in range(4)))
    return sent
