"""`vllm bench serve` (it ships with vLLM; run through the launcher) against the appliance's
proxy, placing requests by `split=always` and by `split=auto`, and against one plain vLLM
server given the same two cores, in one run: request throughput, TTFT, TPOT and ITL at p50
and p99, and where `auto` placed the requests.

    .venv/bin/python bench/serve.py [--workloads tiny,mixed,prefix,chat] [--rounds 2] [--quick]
        [--no-warmup] [--one-core] [--access-log]

Workloads (vLLM's datasets, the model's own tokenizer):
- tiny: the tiny model, short prompts (64-192 tokens) and outputs, a closed loop of 8
  clients, 256 prompts a round (64 took about 2 s, and a round's rate moved by a sixth);
- mixed: the larger-KV model (48 KiB of KV per token), prompts of 100 to 1,900 tokens at
  a steady arrival rate, so long prefills land among running decodes. There a plain
  server's decode steps wait behind each prefill (its ITL p99 spikes) while the
  appliance's D only decodes;
- prefix: the larger-KV model, prompts sharing long prefixes (vLLM's prefix_repetition);
- chat: the larger-KV model, 8 conversations of 4 turns in flight, each turn the whole
  conversation so far plus a new message (bench/multiturn.py).

Each appliance setup is P on CPU 0 and D on CPU 1 behind its own proxy (its own servers:
shared ones would see each prompt twice, a prefix-cache hit); the plain server has both
CPUs. All are up at once and take turns, round by round (each round its own prompts); an
idle server's workers stop polling a second after their last step, so the turns do not
overlap. Before the first round each setup serves a quarter of the workload on prompts of
its own (not counted): a node in service has measured itself long before (a fresh proxy
only times P at start), and a run this short would otherwise weigh auto's first decisions
as a fifth of its requests.
Ratios are setup / plain, and auto / always. With --one-core, a plain server on one CPU
takes its turns too, given half the clients (concurrency, arrival rate, conversations):
twice its rate over the plain server's is what P and D (one CPU each) could reach at best
on this machine, each request whole on one engine, the two perfectly balanced, nothing
computed twice, no transfer (an upper bound: meanwhile the client has the other CPU to
itself).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import multiturn  # noqa: E402
from ttft import SERVED, SETTLE_S, Setup, appliance_setup, serve  # noqa: E402

from appliance import tinymodel  # noqa: E402
from appliance.pdctl.node.status import metric_samples  # noqa: E402
from appliance.process import DECODE_PREFILL_CHUNK, ENGINE_STEP_TOKENS  # noqa: E402
from tests.conftest import free_port  # noqa: E402

console = Console(stderr=True)
METRICS = ("ttft", "tpot", "itl")


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    args: tuple[str, ...]


WORKLOADS = {
    "tiny": Workload("tiny", "tiny", (
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32",
        "--random-range-ratio", "0.5", "--num-prompts", "256", "--max-concurrency", "8")),
    "mixed": Workload("mixed", "kvbench", (
        "--dataset-name", "random", "--random-input-len", "1000", "--random-output-len",
        "48", "--random-range-ratio", "0.9", "--num-prompts", "24", "--request-rate", "1.5",
        "--max-concurrency", "6")),
    "prefix": Workload("prefix", "kvbench", (
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "768",
        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "32", "--num-prompts", "32",
        "--max-concurrency", "8")),
    "chat": Workload("chat", "kvbench", ("multiturn: 8 conversations x 4 turns, 512 + 96 per "
                                         "turn prompt tokens, 32 out",)),
}
SETUPS = ("always", "auto")
ENGINE_TOKENIZER = "auto-dtok"
ONE_CORE = "plain-1cpu"


def plain_setup(model: Path, log_dir: Path, name: str = "plain",
                cpus: tuple[int, ...] = (0, 1)) -> Setup:
    port = free_port()
    return Setup(name, [serve(name, model, port, cpus, log_dir)],
                 plain_url=f"http://127.0.0.1:{port}")


def halved(args: list[str]) -> list[str]:
    """`vllm bench serve` arguments with half the concurrency and arrival rate."""
    out = list(args)
    for flag in ("--max-concurrency", "--request-rate"):
        if flag in out:
            i = out.index(flag) + 1
            out[i] = f"{float(out[i]) / 2:g}" if "." in out[i] else str(max(1, int(out[i]) // 2))
    return out


def bench_serve(url: str, model: Path, work: Workload, seed: int, out: Path,
                quick: bool, half: bool = False) -> dict:
    """`half`: half the clients (conversations, concurrency, arrival rate): one engine's
    share of the workload when two serve it."""
    if work.name == "chat":
        return multiturn.run(url, SERVED, seed, conversations=4 if half else 8, quick=quick)
    args = list(work.args)
    if quick:  # a smoke run: a quarter of the prompts
        i = args.index("--num-prompts")
        args[i + 1] = str(max(4, int(args[i + 1]) // 4))
    if half:
        args = halved(args)
    cmd = [sys.executable, "-m", "appliance.launcher", "bench", "serve", "--backend", "vllm",
           "--base-url", url, "--model", SERVED, "--tokenizer", str(model),
           *args, "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"vllm bench serve failed against {url}:\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def _row(results: list[dict]) -> dict[str, float]:
    """Medians over the rounds of one setup's numbers."""
    keys = ["request_throughput", "completed"] + [f"{q}_{m}_ms" for m in METRICS
                                                  for q in ("p50", "p99")]
    if any("p50_ttft_first_ms" in r for r in results):  # chats: first and later turns
        keys += ["p50_ttft_first_ms", "p50_ttft_later_ms"]
    row = {}
    for key in keys:
        values = [r.get(key) if key in r else r.get(key.replace("p50", "median"))
                  for r in results]
        row[key] = statistics.median([v for v in values if v is not None] or [float("nan")])
    return row


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return metric_samples(text)


def decisions(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """The proxy's placement counts so far: ({"remote": n, "local": m, "p_alone": k},
    {"remote/itl_budget": n, ...} by reason)."""
    out = {"remote": 0.0, "local": 0.0, "p_alone": 0.0}
    why: dict[str, float] = {}
    for name, labels, n in _samples(url):
        if name == "pd_proxy_split_decisions_total":
            where, key = labels["decision"], f"{labels['decision']}/{labels['reason']}"
            out[where] = out.get(where, 0.0) + n
            why[key] = why.get(key, 0.0) + n
    return out, why


def placement_state(url: str) -> str:
    """What auto weighed at the end (its ITL budget and fitted lines), from /status."""
    status = json.loads(urllib.request.urlopen(url + "/status", timeout=10).read())
    split = status.get("split") or {}
    return json.dumps({k: split.get(k) for k in ("itl_budget_ms", "prefill", "handoff",
                                                  "decode_step")})


def _sums(url: str, series: str, by_backend: bool = False) -> dict[str, float]:
    """A series summed over its labels at `url` (per `backend` label when asked)."""
    out: dict[str, float] = {}
    for name, labels, value in _samples(url):
        if name == series:
            key = labels.get("backend", "") if by_backend else url
            out[key] = out.get(key, 0.0) + value
    return out


def index_accuracy(setup: Setup) -> str:
    """The prefix index's predicted cached tokens against what P's and D's engines hit, for
    the requests of this setup's proxy (its engines serve no one else)."""
    predicted = _sums(setup.proxy_url or "", "pd_proxy_prefix_predicted_hits_total", True)
    parts = []
    for role, url in (("P", setup.prefill_url), ("D", setup.decode_url)):
        hits = sum(_sums(url or "", "vllm:prefix_cache_hits_total").values())
        parts.append(f"{role} predicted {predicted.get(url or '', 0):.0f} of {hits:.0f} hit")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="tiny,mixed,prefix,chat")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a quarter of the prompts")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="measure from the first request (auto timed only by its start-up "
                             "calibration)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pd-bench-serve"))
    parser.add_argument("--one-core", action="store_true",
                        help="also a plain server on one CPU given half the clients: twice its "
                             "rate is what P and D (one CPU each) could serve at best")
    parser.add_argument("--access-log", action="store_true",
                        help="the proxies' access lines (each request's placement) in their "
                             "logs under --log-dir")
    parser.add_argument("--decode-chunk", type=int, default=DECODE_PREFILL_CHUNK["cpu"],
                        metavar="TOKENS",
                        help="D's longest prefill chunk while others run, in the appliance "
                             "setups (host config model.decode_prefill_chunk; default: the "
                             "CPU stack's; 0: no cap)")
    parser.add_argument("--step-tokens", type=int, default=ENGINE_STEP_TOKENS["cpu"],
                        metavar="TOKENS",
                        help="each engine's token budget per step in the appliance setups "
                             "(host config model.max_num_batched_tokens; default: the CPU "
                             "stack's; 0: vLLM's own)")
    parser.add_argument("--engine-tokenizer", action="store_true",
                        help=f"also auto with a proxy that asks D's /tokenize for the prefix "
                             f"index ({ENGINE_TOKENIZER}) instead of tokenizing in process")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    tables = []
    for name in args.workloads.split(","):
        work = WORKLOADS[name]
        model = tinymodel.build(ROOT / ".cache" / "models" / work.model, work.model)
        setups = [*(appliance_setup(model, args.log_dir, split, split, args.access_log,
                                    decode_chunk=args.decode_chunk,
                                    step_tokens=args.step_tokens)
                    for split in SETUPS),
                  *([appliance_setup(model, args.log_dir, "auto", ENGINE_TOKENIZER,
                                     args.access_log, tokenizer=False,
                                     decode_chunk=args.decode_chunk,
                                     step_tokens=args.step_tokens)]
                    if args.engine_tokenizer else []),
                  plain_setup(model, args.log_dir),
                  *([plain_setup(model, args.log_dir, ONE_CORE, (0,))] if args.one_core
                    else [])]
        results: dict[str, list[dict]] = {s.name: [] for s in setups}
        placed = {"remote": 0.0, "local": 0.0, "p_alone": 0.0}
        started: list[Setup] = []
        try:
            for setup in setups:
                console.log(f"{name}: starting {setup.name}")
                setup.start()
                started.append(setup)
            auto = next(s for s in setups if s.name == "auto")
            assert auto.proxy_url is not None
            for setup in setups if args.warmup else ():
                time.sleep(SETTLE_S)
                console.log(f"{name}: warm-up, {setup.name}")
                bench_serve(setup.proxy_url or setup.plain_url or "", model, work, 999,
                            args.log_dir / f"{name}-{setup.name}-warmup.json", True,
                            setup.name == ONE_CORE)
            before, before_why = decisions(auto.proxy_url)
            for rnd in range(args.rounds):
                for setup in setups if rnd % 2 == 0 else reversed(setups):
                    time.sleep(SETTLE_S)
                    url = setup.proxy_url or setup.plain_url
                    assert url is not None
                    out = args.log_dir / f"{name}-{setup.name}-{rnd}.json"
                    console.log(f"{name}: round {rnd + 1}, {setup.name}")
                    results[setup.name].append(
                        bench_serve(url, model, work, 1000 + rnd, out, args.quick,
                                    setup.name == ONE_CORE))
            placed, why = decisions(auto.proxy_url)
            placed = {k: v - before.get(k, 0.0) for k, v in placed.items()}
            why = {k: v - before_why.get(k, 0.0) for k, v in why.items()}
            console.log(f"{name}: auto's decisions by reason: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(why.items())))
            console.log(f"{name}: auto's estimates: {placement_state(auto.proxy_url)}")
            console.log(f"{name}: prefix index, auto: {index_accuracy(auto)}")
        finally:
            for setup in reversed(started):
                setup.stop()
        tables.append((work, {k: _row(v) for k, v in results.items()}, placed))

    for work, rows, placed in tables:
        total = sum(placed.values()) or 1
        table = Table(title=f"{work.name} ({work.model}): {' '.join(work.args)}; medians of "
                            f"{args.rounds} rounds; auto placed {placed['local'] / total:.0%} "
                            f"local, {placed['remote'] / total:.0%} remote, "
                            f"{placed['p_alone'] / total:.0%} p_alone")
        table.add_column("metric")
        for setup in rows:
            table.add_column(setup, justify="right")
        compared = [s for s in (*SETUPS, ENGINE_TOKENIZER) if s in rows]
        for setup in compared:
            table.add_column(f"{setup} / plain", justify="right")
        table.add_column("auto / always", justify="right")
        if ONE_CORE in rows:
            table.add_column(f"2 x {ONE_CORE} / plain", justify="right")
        for key in rows["plain"]:
            p = rows["plain"][key]
            cells = [f"{rows[s][key]:.2f}" for s in rows]
            cells += [_ratio(rows[s][key], p) for s in compared]
            cells.append(_ratio(rows["auto"][key], rows["always"][key]))
            if ONE_CORE in rows:  # a rate doubles over two engines; latencies do not
                cells.append(_ratio(2 * rows[ONE_CORE][key], p)
                             if key == "request_throughput" else "")
            table.add_row(key, *cells)
        Console().print(table)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


if __name__ == "__main__":
    main()
