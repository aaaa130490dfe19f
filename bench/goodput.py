"""Goodput: the highest Poisson arrival rate at which at least 90% of requests meet a TTFT
and a worst-gap SLO (bench/slo.py), for a plain vLLM server given both CPUs and the
appliance (P on CPU 0, D on CPU 1, its own proxy) placing by `split=always` and by
`split=auto`, in one run; and raw throughput (each setup's best completed rate).

    .venv/bin/python bench/goodput.py [--workloads short,mid,long,prefix,chat]
        [--seeds 1] [--prompts 12] [--points 3] [--rate-scale 1] [--two-proxies]
        [--splits always,auto] [--access-log] [--log-dir DIR]

Workloads (the larger-KV model, its own tokenizer; `vllm bench serve`'s datasets, open
loop, `--ignore-eos`):
- short, mid, long: `random` at 128, 512 and 1,536 prompt tokens, 64 or 128 out;
- prefix: `prefix_repetition`, 4 prefixes of 1,024 tokens + 128 of each prompt's own;
- chat: conversations of 4 turns arriving at random, each turn the whole conversation so
  far plus a new message (bench/multiturn.py's run_open; its rate counts turns).
Each setup starts fresh. Its first run, at the lowest rate before anything else, is the
cold one (reported apart); then a warm-up at the highest rate (not counted); then the sweep,
the setups taking turns at each rate. SLOs come from the plain server's run at the lowest
rate: TTFT within 4x its median, and the worst gap within 3x its median step (tight: one
prefill among running decodes breaks it) or 20x (loose). The plain server runs with the
flags the node's engines run with on CPU (`--enforce-eager`, the same KV bytes), else vLLM's
defaults. Every run is printed and kept as JSON under --log-dir; nothing is picked.
With --two-proxies, `auto-2p` is auto behind two proxies (one P and D), the same load dealt
out to them in turn by a front (bench/splitter.py): what the engines' own load gauges buy
(appliance.proxy.nodes.engineload). --splits picks the node's setups (plain always runs:
the SLOs are its).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import multiturn  # noqa: E402
import slo  # noqa: E402
from serve import decisions, plain_setup  # noqa: E402
from ttft import SERVED, SETTLE_S, Setup, appliance_setup  # noqa: E402

from appliance import tinymodel  # noqa: E402
from tests.conftest import free_port  # noqa: E402

console = Console(stderr=True)
MODEL = "kvbench"


@dataclass(frozen=True)
class Workload:
    name: str
    args: tuple[str, ...]  # `vllm bench serve` dataset flags; () for the multi-turn client
    rates: tuple[float, float]  # the sweep's lowest and highest arrival rate, requests/s


WORKLOADS = {
    "short": Workload("short", ("--dataset-name", "random", "--random-input-len", "128",
                                "--random-output-len", "64", "--random-range-ratio", "0.5"),
                      (1.0, 4.0)),
    "mid": Workload("mid", ("--dataset-name", "random", "--random-input-len", "512",
                            "--random-output-len", "128", "--random-range-ratio", "0.5"),
                    (0.4, 1.6)),
    "long": Workload("long", ("--dataset-name", "random", "--random-input-len", "1536",
                              "--random-output-len", "128", "--random-range-ratio", "0.2"),
                     (0.2, 0.8)),
    "prefix": Workload("prefix", ("--dataset-name", "prefix_repetition",
                                  "--prefix-repetition-prefix-len", "1024",
                                  "--prefix-repetition-suffix-len", "128",
                                  "--prefix-repetition-num-prefixes", "4",
                                  "--prefix-repetition-output-len", "128"), (0.3, 1.2)),
    "chat": Workload("chat", (), (0.4, 1.6)),
}
SETUPS = ("plain", "always", "auto")
TWO_PROXIES = "auto-2p"  # auto, two proxies in front of one P and D, each half the load


def two_proxies(model: Path, log_dir: Path, access_log: bool = False
                ) -> tuple[Setup, list[str]]:
    """`auto` with a second proxy beside the first (same P and D, same settings), and a
    front that deals requests out to them in turn (bench/splitter.py, as a load balancer
    would): the setup, whose URL is the front's, and both proxies' URLs. The same load as
    the other setups' meets it: the same requests at the same times."""
    setup = appliance_setup(model, log_dir, "auto", TWO_PROXIES, access_log)
    first = setup.services[-1]
    port = free_port()
    argv = list(first.argv)
    argv[argv.index("--port") + 1] = str(port)
    url = f"http://127.0.0.1:{port}"
    second = replace(first, name=f"{TWO_PROXIES}-proxy-b", argv=argv,
                     log_path=log_dir / f"{TWO_PROXIES}-proxy-b.log",
                     health_url=f"{url}/health")
    proxies = [setup.proxy_url or "", url]
    front = free_port()
    splitter = replace(first, name=f"{TWO_PROXIES}-front",
                       argv=[sys.executable, str(ROOT / "bench" / "splitter.py"), str(front),
                             *proxies],
                       log_path=log_dir / f"{TWO_PROXIES}-front.log",
                       health_url=f"http://127.0.0.1:{front}/health")
    setup.services += [second, splitter]
    setup.proxy_url = f"http://127.0.0.1:{front}"
    return setup, proxies


def run_once(url: str, model: Path, work: Workload, rate: float, prompts: int, seed: int,
             out: Path) -> dict:
    """One open-loop run; its detailed result (per request TTFT, gaps, errors)."""
    if not work.args:
        result = multiturn.run_open(url, SERVED, seed, rate, conversations=max(1, prompts // 4))
        out.write_text(json.dumps(result))
        return result
    cmd = [sys.executable, "-m", "appliance.launcher", "bench", "serve", "--backend", "vllm",
           "--base-url", url, "--model", SERVED, "--tokenizer", str(model), *work.args,
           "--num-prompts", str(prompts), "--request-rate", f"{rate:g}", "--ignore-eos",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
           "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"vllm bench serve failed against {url}:\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-3000:]}")
    return json.loads(out.read_text())


@dataclass
class Sweep:
    """One workload and seed: each setup's cold run and its run at each rate."""
    work: Workload
    seed: int
    rates: list[float]
    cold: dict[str, dict]
    runs: dict[str, dict[float, dict]]
    placed: dict[str, float]
    # auto-2p's, both proxies' together (empty without it)
    placed_2p: dict[str, float] = field(default_factory=dict)

    def slos(self) -> tuple[slo.Slo, slo.Slo]:
        return slo.slos_from(slo.Detail.of(self.runs["plain"][self.rates[0]]))


def sweep(work: Workload, seed: int, prompts: int, points: int, log_dir: Path,
          with_two: bool = False, scale: float = 1.0, splits: tuple[str, ...] = SETUPS[1:],
          access_log: bool = False) -> Sweep:
    model = tinymodel.build(ROOT / ".cache" / "models" / MODEL, MODEL)
    setups: list[Setup] = [plain_setup(model, log_dir),
                           *(appliance_setup(model, log_dir, split, split, access_log)
                             for split in splits)]
    proxies: list[str] = []
    if with_two:
        two, proxies = two_proxies(model, log_dir, access_log)
        setups.append(two)
    url = {s.name: s.proxy_url or s.plain_url or "" for s in setups}
    rates = slo.geometric_rates(work.rates[0], work.rates[1] * scale, points)
    result = Sweep(work, seed, rates, {}, {s.name: {} for s in setups}, {})
    started: list[Setup] = []
    try:
        for setup in setups:
            console.log(f"{work.name} seed {seed}: starting {setup.name}")
            setup.start()
            started.append(setup)
        for phase, rate, run_seed in (("cold", rates[0], seed + 500),
                                      ("warm-up", rates[-1], seed + 900)):
            for setup in setups:
                time.sleep(SETTLE_S)
                console.log(f"{work.name} seed {seed}: {phase} at {rate:g}/s, {setup.name}")
                got = run_once(url[setup.name], model, work, rate, prompts, run_seed,
                               log_dir / f"{work.name}-{seed}-{setup.name}-{phase}.json")
                if phase == "cold":
                    result.cold[setup.name] = got
        before, _ = decisions(url["auto"]) if "auto" in url else ({}, {})
        before_2p = [decisions(u)[0] for u in proxies]
        for i, rate in enumerate(rates):
            for setup in setups if i % 2 == 0 else reversed(setups):
                time.sleep(SETTLE_S)
                console.log(f"{work.name} seed {seed}: {rate:g}/s, {setup.name}")
                result.runs[setup.name][rate] = run_once(
                    url[setup.name], model, work, rate, prompts, seed * 10 + i,
                    log_dir / f"{work.name}-{seed}-{setup.name}-{rate:g}.json")
        if "auto" in url:
            after, why = decisions(url["auto"])
            result.placed = {k: v - before.get(k, 0.0) for k, v in after.items()}
            console.log(f"{work.name} seed {seed}: auto's decisions by reason: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(why.items())))
        for u, was in zip(proxies, before_2p, strict=True):
            for k, v in decisions(u)[0].items():
                result.placed_2p[k] = result.placed_2p.get(k, 0.0) + v - was.get(k, 0.0)
    finally:
        for setup in reversed(started):
            setup.stop()
    return result


def summary(s: Sweep) -> dict:
    """Goodput per SLO, raw throughput, and the cold runs' numbers, per setup."""
    out: dict = {"workload": s.work.name, "seed": s.seed, "rates": s.rates,
                 "auto_placed": s.placed, "auto_2p_placed": s.placed_2p, "slos": {},
                 "setups": {}}
    slos = s.slos()
    for x in slos:
        out["slos"][x.name] = {"ttft_ms": x.ttft_ms, "gap_ms": x.gap_ms}
    for name, runs in s.runs.items():
        row: dict = {"throughput": max(r["request_throughput"] for r in runs.values()),
                     "cold_throughput": s.cold[name]["request_throughput"]}
        for x in slos:
            shares = [(rate, slo.attainment(slo.Detail.of(runs[rate]), x)) for rate in s.rates]
            row[f"{x.name}_attainment"] = dict(shares)
            row[f"{x.name}_goodput"] = slo.goodput_rate(shares)
            row[f"{x.name}_cold_attainment"] = slo.attainment(slo.Detail.of(s.cold[name]), x)
        out["setups"][name] = row
    return out


def _placed(placed: dict[str, float]) -> str:
    total = sum(placed.values()) or 1
    return ", ".join(f"{placed.get(k, 0) / total:.0%} {k}" for k in ("local", "remote", "p_alone"))


def print_table(sm: dict) -> None:
    slos = "; ".join(f"{k}: TTFT <= {v['ttft_ms']:.0f} ms, worst gap <= {v['gap_ms']:.0f} ms"
                     for k, v in sm["slos"].items())
    placed = f"auto placed {_placed(sm['auto_placed'])}" if sm["auto_placed"] else ""
    if sm.get("auto_2p_placed"):
        placed += f"; {TWO_PROXIES} placed {_placed(sm['auto_2p_placed'])}"
    table = Table(title=f"{sm['workload']} seed {sm['seed']}, rates {sm['rates']} req/s; "
                        f"{slos}; {placed}")
    table.add_column("setup")
    for name in sm["slos"]:
        table.add_column(f"{name} goodput req/s", justify="right")
        table.add_column(f"{name} / plain", justify="right")
        table.add_column(f"{name} met at each rate", justify="right")
        table.add_column(f"{name} met, cold", justify="right")
    table.add_column("throughput req/s", justify="right")
    table.add_column("/ plain", justify="right")
    table.add_column("cold req/s", justify="right")
    table.add_column("cold / plain", justify="right")
    plain = sm["setups"]["plain"]
    for name, row in sm["setups"].items():
        cells = []
        for x in sm["slos"]:
            # At the sweep's highest rate: at least that (the sweep did not find the limit).
            top = "≥" if row[f"{x}_goodput"] >= sm["rates"][-1] else ""
            cells += [f"{top}{row[f'{x}_goodput']:g}", slo.ratio(row[f"{x}_goodput"],
                                                                 plain[f"{x}_goodput"]),
                      " ".join(f"{v:.0%}" for v in row[f"{x}_attainment"].values()),
                      f"{row[f'{x}_cold_attainment']:.0%}"]
        cells += [f"{row['throughput']:.2f}", slo.ratio(row["throughput"], plain["throughput"]),
                  f"{row['cold_throughput']:.2f}",
                  slo.ratio(row["cold_throughput"], plain["cold_throughput"])]
        table.add_row(name, *cells)
    Console(width=220).print(table)  # one row a setup, even into a file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seeds", default="1", help="comma-separated; each a whole sweep")
    parser.add_argument("--prompts", type=int, default=12, help="requests per run")
    parser.add_argument("--points", type=int, default=3, help="arrival rates per sweep")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pd-bench-goodput"))
    parser.add_argument("--two-proxies", action="store_true",
                        help=f"also {TWO_PROXIES}: auto with two proxies in front of one P and "
                             f"D, a front dealing the requests out to them in turn")
    parser.add_argument("--splits", default=",".join(SETUPS[1:]),
                        help="the node's setups beside the plain server (comma-separated "
                             "split policies)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="multiplies each workload's highest arrival rate (the SLOs "
                             "come from its lowest, which stays)")
    parser.add_argument("--access-log", action="store_true",
                        help="the proxies' access lines in their logs (each decision with "
                             "what it weighed), to compare one proxy's decisions with two's")
    parser.add_argument("--render", action="store_true",
                        help="print the tables of the runs kept under --log-dir; run nothing")
    args = parser.parse_args()
    if args.render:
        for path in sorted(args.log_dir.glob("summary-*.json")):
            print_table(json.loads(path.read_text()))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    summaries = []
    for name in args.workloads.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            sm = summary(sweep(WORKLOADS[name], seed, args.prompts, args.points, args.log_dir,
                               args.two_proxies, args.rate_scale,
                               tuple(x for x in args.splits.split(",") if x),
                               args.access_log))
            (args.log_dir / f"summary-{name}-{seed}.json").write_text(json.dumps(sm, indent=1))
            summaries.append(sm)
            print_table(sm)  # as each ends: a long run shows what it has so far
    console.rule("all runs")
    for sm in summaries:
        print_table(sm)


if __name__ == "__main__":
    main()
