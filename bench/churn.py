"""What each ordinary churn event costs a 1P1D node under steady traffic: P restarted (its
process group SIGKILLed, then started again), P frozen (SIGSTOP 6 s, then SIGCONT), D restarted.

A local node (tiny model, P on CPU 0, D on CPU 1, proxy `--health-interval 0.5 --split MODE`)
serves 4 clients: greedy completions of 64-256 token ids, 16 out, half streamed, each with its
own `cache_salt` so no prefix cache hides a recomputation. A reference window answers each
prompt seed once (64; 16 with --quick); per event, a baseline window and an event window (until
the event ends, healthy again or thawed, plus 20 s; 12 with --quick) reuse them. Per window:
- requests, failures (not 200, an SSE error, no [DONE], a client error or a 60 s timeout) and
  for how long; answers unlike their seed's reference; the worst latency over the baseline p50;
- prompt tokens prefilled twice: P's plus D's `vllm:request_prefill_kv_computed_tokens_sum`
  (followed across restarts) less the prompt tokens answered, also in prompts; below 0 around
  a kill, as a killed engine never reports work it had not finished;
- P's KV blocks held, sampled every 0.5 s: the most, 10 s after the event ended, and idle;
- seconds until the node is back in the proxy's rotation; where the proxy placed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance import tinymodel  # noqa: E402
from appliance.localnode import LocalNode, NodeSpec  # noqa: E402
from appliance.pdctl.node.status import metric_samples  # noqa: E402
from tests.conftest import free_port  # noqa: E402

COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"
KV_USAGE = "vllm:kv_cache_usage_perc"
DECISIONS = "pd_proxy_split_decisions_total"
CLIENTS, MAX_TOKENS, SERVED, SEED_BASE = 4, 16, "tiny", 1_000_000
REQUEST_TIMEOUT_S, FAIL_PAUSE_S, SAMPLE_EVERY_S = 60.0, 0.5, 0.5
LEAD_S, SETTLE_S, FREEZE_S, RESTART_LIMIT_S, ROTATION_LIMIT_S = 1.0, 1.5, 6.0, 300.0, 120.0
# --events, in the order they run: the window's name, the role hit, frozen (else restarted)
EVENTS = {"p-restart": ("P restart", "prefill", False),
          "p-freeze": (f"P frozen {FREEZE_S:.0f} s", "prefill", True),
          "d-restart": ("D restart", "decode", False)}
log = Console(stderr=True)
Pick = Callable[[random.Random], "int | None"]  # a client's next prompt seed (None: stop)
Span = tuple[float, float, "float | None"]  # an event's start, end, back in rotation (mono s)


class Timing(NamedTuple):
    refs: int  # prompt seeds answered before any event
    baseline_s: float
    after_s: float  # event window past the event's end
    max_requests: int = 3000  # per window


FULL, QUICK = Timing(64, 20.0, 20.0), Timing(16, 6.0, 12.0)


class Result(NamedTuple):  # one request (monotonic seconds)
    seed: int
    prompt_tokens: int
    start: float
    end: float
    ok: bool
    text: str


@dataclass
class Counter:
    """A Prometheus counter followed across restarts (a lower value: it started again at 0)."""
    last: float | None = None
    total: float = 0.0

    def update(self, value: float) -> None:
        if self.last is not None:
            self.total += value - self.last if value >= self.last else value
        self.last = value


def summarize(results: list[Result], refs: dict[int, str], base_p50: float | None,
              computed: float) -> dict[str, Any]:
    """One window's numbers from its requests and the prompt tokens P and D computed in it."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    latencies = [r.end - r.start for r in results]
    p50 = statistics.median_high([r.end - r.start for r in ok]) if ok else math.nan
    base = p50 if base_p50 is None else base_p50
    once = sum(r.prompt_tokens for r in ok)
    extra = computed - once
    return {
        "requests": len(results), "failed": len(failed),
        "failing_s": max(r.end for r in failed) - min(r.start for r in failed) if failed else 0.0,
        "mismatches": sum(1 for r in ok if r.seed in refs and r.text != refs[r.seed]),
        "p50_s": p50, "worst_added_s": max(latencies) - base if latencies else math.nan,
        "prefilled_twice_tokens": extra,
        "prefilled_twice_prompts": extra / (once / len(ok)) if ok and once else math.nan,
    }


def kv_report(samples: list[tuple[float, float | None]], start: float, end: float,
              after: float | None) -> tuple[float | None, float | None]:
    """(most held in [start, end], the first value at or past `after`); None: no sample."""
    seen = [v for t, v in samples if start <= t <= end and v is not None]
    later = [v for t, v in samples if after is not None and t >= after and v is not None]
    return (max(seen) if seen else None), (later[0] if later else None)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(rng.randrange(64, 257))]


def parse_answer(raw: str, stream: bool) -> tuple[bool, str]:
    """(answered, text) of a 200 body: a stream's text joined from its events."""
    try:
        if not stream:
            return True, json.loads(raw)["choices"][0]["text"]
        events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    except (ValueError, KeyError, IndexError, TypeError):
        return False, raw
    if any("error" in e for e in events) or not raw.rstrip().endswith("data: [DONE]"):
        return False, raw
    return True, "".join(c.get("text", "") for e in events for c in e.get("choices", ()))


def parse_events(text: str) -> list[str]:
    """--events: a comma list of EVENTS' names; they run in EVENTS' order."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    if not names or not names <= EVENTS.keys():
        raise argparse.ArgumentTypeError(f"a comma list of {', '.join(EVENTS)}, not {text!r}")
    return [e for e in EVENTS if e in names]


class Sampler:
    """P's and D's /metrics every 0.5 s: their computed prompt tokens and P's KV blocks."""

    def __init__(self, node: LocalNode) -> None:
        self.urls = {"P": node.spec.prefill_url, "D": node.spec.decode_url}
        self.computed = {role: Counter() for role in self.urls}
        self.kv: list[tuple[float, float | None]] = []
        self.blocks_total: int | None = None
        self.lock = asyncio.Lock()

    async def _get(self, http: aiohttp.ClientSession, url: str) -> list | None:
        try:
            async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return metric_samples(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def sample(self, http: aiohttp.ClientSession) -> float:
        """One sample; returns the prompt tokens P and D computed so far."""
        async with self.lock:  # one at a time: an older value must not read as a restart
            t = time.monotonic()
            got = await asyncio.gather(*(self._get(http, u) for u in self.urls.values()))
            for role, samples in zip(self.urls, got, strict=True):
                if samples is not None:
                    self.computed[role].update(sum(v for n, _, v in samples if n == COMPUTED))
            for n, labels, _ in got[0] or ():  # P's
                if n == "vllm:cache_config_info" and str(labels.get("num_gpu_blocks")).isdigit():
                    self.blocks_total = int(labels["num_gpu_blocks"])
            usage = max((v for n, _, v in got[0] or () if n == KV_USAGE), default=None)
            self.kv.append((t, None if usage is None else usage * (self.blocks_total or 100)))
            return sum(c.total for c in self.computed.values())

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + 3600  # bounded, as every loop here
        while not stop.is_set() and time.monotonic() < deadline:
            await self.sample(http)
            await asyncio.sleep(SAMPLE_EVERY_S)


class Churn:
    def __init__(self, node: LocalNode, timing: Timing, events: list[str]) -> None:
        self.node, self.timing, self.events = node, timing, events
        self.url = node.spec.proxy_url or ""
        self.sampler = Sampler(node)
        self.refs: dict[int, str] = {}
        self.rows: list[dict[str, Any]] = []
        self._left = 0

    async def ask(self, http: aiohttp.ClientSession, seed: int, stream: bool) -> Result:
        ids = prompt(seed)
        body = {"model": SERVED, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": stream, "cache_salt": uuid.uuid4().hex}
        start, ok, text = time.monotonic(), False, ""
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.post(self.url + "/v1/completions", json=body,
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as r:
                raw = await r.text()
                if r.status == 200:
                    ok, text = parse_answer(raw, stream)
        return Result(seed, len(ids), start, time.monotonic(), ok, text)

    async def client(self, http: aiohttp.ClientSession, rng: random.Random,
                     stop: asyncio.Event, pick: Pick, out: list[Result], deadline: float) -> None:
        while not stop.is_set() and time.monotonic() < deadline and self._left > 0:
            seed = pick(rng)
            if seed is None:
                return
            self._left -= 1
            result = await self.ask(http, seed, stream=rng.random() < 0.5)
            out.append(result)
            if not result.ok:
                await asyncio.sleep(FAIL_PAUSE_S)

    async def placed(self, http: aiohttp.ClientSession) -> dict[str, float]:
        """The proxy's placement decisions so far."""
        out: dict[str, float] = {}
        async with http.get(self.url + "/metrics") as r:
            for n, labels, v in metric_samples(await r.text()):
                if n == DECISIONS:
                    decision = labels.get("decision", "?")
                    out[decision] = out.get(decision, 0) + v
        return out

    async def rotation(self, http: aiohttp.ClientSession, role: str) -> float | None:
        """When every `role` node is in the proxy's rotation (monotonic s; None: not soon)."""
        deadline = time.monotonic() + ROTATION_LIMIT_S
        while time.monotonic() < deadline:
            async with http.get(self.url + "/status") as r:
                status = await r.json()
            if all(b["in_rotation"] for b in status[role]):
                return time.monotonic()
            await asyncio.sleep(0.2)
        log.print(f"{role} not back in rotation within {ROTATION_LIMIT_S:.0f} s")
        return None

    async def hit(self, http: aiohttp.ClientSession, role: str, freeze: bool) -> Span:
        """Restart `role` (until healthy again) or freeze it (until thawed)."""
        svc = self.node.prefill if role == "prefill" else self.node.decode
        assert svc.proc is not None
        await self.sampler.sample(http)  # the counters just before the event
        t0 = time.monotonic()
        if freeze:
            os.killpg(svc.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(FREEZE_S)
            finally:
                os.killpg(svc.proc.pid, signal.SIGCONT)
        else:
            os.killpg(svc.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(svc.proc.wait, 30)
            svc.start()
            await asyncio.to_thread(svc.wait_healthy, RESTART_LIMIT_S)
            log.print(f"{svc.name} restarted, healthy after {time.monotonic() - t0:.1f} s")
        return t0, time.monotonic(), await self.rotation(http, role)

    async def window(self, http: aiohttp.ClientSession, name: str, pick: Pick, duration: float,
                     event: tuple[str, bool] | None = None) -> list[Result]:
        """The clients for `duration` s, or with an event (hit's arguments) from LEAD_S before
        it until `duration` s past its end; adds the window's row, returns its requests."""
        results: list[Result] = []
        computed0, placed0 = await self.sampler.sample(http), await self.placed(http)
        stop, self._left = asyncio.Event(), self.timing.max_requests
        span: Span | None = None
        start, n = time.monotonic(), len(self.rows) + 1  # n: seeds the clients' choices
        hard = start + duration + RESTART_LIMIT_S + ROTATION_LIMIT_S
        tasks = [asyncio.create_task(self.client(http, random.Random(k * 7919 + n), stop, pick,
                                                 results, hard)) for k in range(CLIENTS)]
        try:
            until = start + duration
            if event is not None:
                await asyncio.sleep(LEAD_S)  # requests in flight when it hits
                span = await self.hit(http, *event)
                until = span[1] + duration
            await asyncio.wait(tasks, timeout=max(0.0, until - time.monotonic()))
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5)
            for t in tasks:
                t.cancel()
        end = time.monotonic()
        await asyncio.sleep(SETTLE_S)  # the last finished requests reach /metrics
        computed = await self.sampler.sample(http) - computed0
        placed = {k: int(v - placed0.get(k, 0)) for k, v in (await self.placed(http)).items()}
        kv = self.sampler.kv
        t0, t1, back = span if span is not None else (None, None, None)
        base_p50 = self.rows[-1]["p50_s"] if span is not None else None
        kv_max, kv_after = kv_report(kv, start, end, None if t1 is None else t1 + 10)
        row = {"window": name, **summarize(results, self.refs, base_p50, computed),
               "p_kv_max": kv_max, "p_kv_after_10s": kv_after, "p_kv_idle": kv[-1][1],
               "back_in_rotation_s": None if t0 is None or back is None else back - t0,
               "placed": {k: v for k, v in placed.items() if v}}
        if span is not None:
            row["p_kv_timeline"] = [(round(t - span[0], 1), v) for t, v in kv
                                    if start <= t <= end]
        self.rows.append(row)
        log.print(f"{name}: {row['requests']} requests, {row['failed']} failed")
        return results

    async def run(self) -> None:
        t = self.timing
        async with aiohttp.ClientSession() as http:
            stop = asyncio.Event()
            sampling = asyncio.create_task(self.sampler.run(http, stop))
            try:
                fresh = iter(range(SEED_BASE, SEED_BASE + t.refs))
                ref = await self.window(http, "reference", lambda _: next(fresh, None),
                                        t.baseline_s + 120)
                self.refs = {r.seed: r.text for r in ref if r.ok}
                seeds = sorted(self.refs)
                if not seeds:
                    raise RuntimeError("no reference answer: the node answered nothing")
                for name, role, freeze in (EVENTS[e] for e in self.events):
                    await self.window(http, f"before {name}", lambda r: r.choice(seeds),
                                      t.baseline_s)
                    await self.window(http, name, lambda r: r.choice(seeds), t.after_s,
                                      (role, freeze))
            finally:
                stop.set()
                await asyncio.wait([sampling], timeout=5)

    def report(self) -> list[dict[str, Any]]:
        """The rows of the windows after the reference; NaN: None."""
        return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
                for r in self.rows[1:]]


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def table(rows: list[dict[str, Any]], unit: str, split: str) -> Table:
    t = Table(title=f"churn events on a 1P1D node (tiny model, proxy --split {split}, 4 "
                    "clients, 16 tokens out); latencies in s, the event rows' 'worst added' "
                    "over the baseline's p50")
    for col in ("window", "requests", "failed (for s)", "mismatches", "p50", "worst added",
                "prefilled twice: tokens (prompts)", f"P KV {unit}: max", "10 s after", "idle",
                "back in rotation s", "placed local/P alone/remote"):
        t.add_column(col, justify="left" if col == "window" else "right")
    for r in rows:
        t.add_row(r["window"], str(r["requests"]), f"{r['failed']} ({_f(r['failing_s'])})",
                  str(r["mismatches"]), _f(r["p50_s"], 2), _f(r["worst_added_s"], 2),
                  f"{r['prefilled_twice_tokens']:,.0f} ({_f(r['prefilled_twice_prompts'])})",
                  _f(r["p_kv_max"]), _f(r["p_kv_after_10s"]), _f(r["p_kv_idle"]),
                  _f(r["back_in_rotation_s"]),
                  "/".join(str(r["placed"].get(k, 0)) for k in ("local", "p_alone", "remote")))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter windows, fewer seeds")
    ap.add_argument("--split", choices=["auto", "always", "never"], default="auto",
                    help="the proxy's --split (default: its default, auto); always: P "
                         "prefills every request, D pulls its KV")
    ap.add_argument("--events", type=parse_events, default=list(EVENTS),
                    help=f"a comma list of {','.join(EVENTS)} (default: all)")
    ap.add_argument("--model-dir", type=Path, help="a built tiny model (default: a temp one)")
    ap.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    ap.add_argument("--log-dir", type=Path, help="the node's logs (default: a temp dir)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-churn-"))
    with tempfile.TemporaryDirectory(prefix="pd-churn-model-") as tmp:
        model = args.model_dir or tinymodel.build(Path(tmp) / "tiny", "tiny")
        node = LocalNode(NodeSpec(
            model=model, prefill_port=free_port(), decode_port=free_port(),
            bootstrap_port=free_port(), proxy_port=free_port(), log_dir=log_dir,
            proxy_args=(*NodeSpec.proxy_args, "--split", args.split)))
        log.print(f"starting the node (--split {args.split}; logs in {log_dir})")
        bench = Churn(node, QUICK if args.quick else FULL, args.events)
        try:
            node.start(timeout=400, progress=lambda n, s: log.print(f"  {n} up after {s:.0f} s"))
            asyncio.run(bench.run())
        finally:  # never leave P stopped: a stopped group ignores SIGTERM until thawed
            with contextlib.suppress(ProcessLookupError):
                if node.prefill.proc is not None:
                    os.killpg(node.prefill.proc.pid, signal.SIGCONT)
            node.stop()
    rows, blocks = bench.report(), bench.sampler.blocks_total
    unit = "blocks" if blocks else "%"
    out = Console(width=220, stderr=args.json)
    out.print(table(rows, unit, args.split))
    out.print(f"P's KV cache: {blocks or '?'} blocks; reference answers for {len(bench.refs)} "
              f"seeds; failed requests pause {FAIL_PAUSE_S} s")
    if args.json:
        print(json.dumps({"split": args.split, "events": args.events, "unit": unit,
                          "blocks_total": blocks, "windows": rows}, indent=1))


if __name__ == "__main__":
    main()
