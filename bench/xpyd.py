"""Requests per second and TTFT through the proxy for 1P1D, 2P1D and 1P2D in one run, how
2P2D routes prompts that share prefixes by policy (round_robin, the SGLang gateway's
cache-aware rule on the prefix index, and cache_aware, the default), and how long the proxy
takes to notice a node removed or added.

    .venv/bin/python bench/xpyd.py [--rounds 2] [--requests 32] [--concurrency 8]
                                   [--skip-discovery]

Four hosts (network namespaces on one switch, as in tests/e2e/test_pd_xpyd.py) are brought
up from one cluster description through `pdctl render --cluster`: p0 and p1 (P) share CPU 0,
d0 and d1 (D) share CPU 1, so the machine's two cores are split between the roles the same
way in every topology. Three proxies on d0 front 1P1D (p0, d0), 2P1D (p0, p1, d0) and 1P2D
(p0, d0, d1); they take turns, round by round, with the same streaming load (random prompts
of 64-448 tokens, 32 tokens out, ignore_eos). On this 2-core machine a second P or D shares
its role's core, so more instances cannot add capacity here: the table shows what the extra
routing costs, not GPU-host scaling.

Routing (2P2D, every policy in front of the same four engines, taking turns, each round and
policy with prefixes of its own so no setup finds another's in the caches): streams whose
prompts are one of 16 shared prefixes (512 tokens) and a suffix of their own (64), 16 out;
req/s, TTFT, and the prompt tokens the four engines computed per request (neither cached
nor received as KV: vLLM's request_prefill_kv_computed_tokens).

Noticing (static backends, the health poll: 2 s interval, down after 2 failures): p1
frozen (SIGSTOP) until the 2P1D proxy has it out of rotation, then thawed until it is back.
Discovery (Kubernetes, when tests/k8s can build its control plane): a pod marked Ready until
the proxy knows it, marked not Ready until it is gone, through a real API server's watch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance import tinymodel  # noqa: E402
from appliance.process import ServiceProcess  # noqa: E402
from tests.conftest import MODEL_CACHE  # noqa: E402
from tests.e2e.cluster_up import bring_up, render, wait_ready  # noqa: E402
from tests.e2e.fabric import fabric  # noqa: E402
from tests.e2e.test_pd_xpyd import description  # noqa: E402

console = Console(stderr=True)
HOSTS = [("p0", 1, {"prefill": [[0]]}), ("p1", 1, {"prefill": [[0]]}),
         ("d1", 2, {"decode": [[1]]}), ("d0", 2, {"decode": [[1]]})]  # the proxy on d0
SHAPES = {"1P1D": (["p0"], ["d0"]), "2P1D": (["p0", "p1"], ["d0"]),
          "1P2D": (["p0"], ["d0", "d1"])}
ALL = (["p0", "p1"], ["d0", "d1"])
POLICIES = ("round_robin", "cache_aware_sglang", "cache_aware")
# Prompt tokens an engine computed in prefills (neither in its cache nor received as KV).
COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"


def _proxy(cluster, shape: str, port: int, log_dir: Path,
           policy: str | None = None) -> ServiceProcess:
    """The rendered proxy's command with this shape's backends only (and `policy`)."""
    argv = cluster.services["d0/proxy"].argv
    command = argv[argv.index(sys.executable):]
    kept, skip = [], 0
    for arg in command:  # drop every --prefill/--decode pair, and the port
        if skip:
            skip -= 1
            continue
        if arg in ("--prefill", "--decode", "--port"):
            skip = 1
            continue
        kept.append(arg)
    prefill, decode = SHAPES.get(shape, ALL)
    if policy is not None:
        kept += ["--policy", policy]
    for name in prefill:
        ip = cluster.hosts[name].ip
        kept += ["--prefill", f"http://{ip}:8010,http://{ip}:8998"]
    for name in decode:
        kept += ["--decode", f"http://{cluster.hosts[name].ip}:8020"]
    return ServiceProcess(f"proxy-{shape}", cluster.hosts["d0"].run(
        [*kept, "--port", str(port), "--no-log-requests", "--health-interval", "2"]),
        log_dir / f"proxy-{shape}.log")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1900) for _ in range(rng.randrange(64, 448))] for _ in range(n)]


def _prefixed(n: int, seed: int, prefixes: int = 16) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(10, 1900) for _ in range(512)] for _ in range(prefixes)]
    return [shared[rng.randrange(prefixes)] + [rng.randrange(10, 1900) for _ in range(64)]
            for _ in range(n)]


def _computed(cluster) -> float:
    """Prompt tokens the four engines computed so far."""
    urls = [f"http://{cluster.hosts[h].ip}:{port}" for h, port in
            (("p0", 8010), ("p1", 8010), ("d0", 8020), ("d1", 8020))]
    sums = cluster.driver("d0", {"op": "metrics", "urls": urls, "series": [COMPUTED]})["sums"]
    return sum(s[COMPUTED] for s in sums.values())


def routing_table(cluster, urls: dict[str, str], args) -> Table:
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for r in range(args.rounds):
        for i, policy in enumerate(POLICIES):
            prompts = _prefixed(args.requests * 2, seed=5000 + 100 * r + i)
            file = Path(tempfile.mkdtemp(prefix="pd-xpyd-prompts-")) / "prompts.json"
            file.write_text(json.dumps(prompts))  # more than one argument may hold
            before = _computed(cluster)
            out = cluster.driver("d0", {"op": "load", "proxy": urls[policy],
                                        "prompts_file": str(file), "max_tokens": 16,
                                        "concurrency": args.concurrency})
            out["computed"] = (_computed(cluster) - before) / len(prompts)
            out["n"] = len(prompts)
            results[policy].append(out)
            console.print(f"round {r + 1} 2P2D {policy}: {len(prompts) / out['wall_s']:.2f} "
                          f"req/s, {out['computed']:.0f} tokens computed per request, "
                          f"{out['errors']} errors")
    table = Table(title=f"2P2D, prompts of 16 shared 512-token prefixes + 64 of their own, "
                        f"16 out, concurrency {args.concurrency} (medians of rounds)")
    for col in ("policy", "req/s", "TTFT p50 ms", "TTFT p99 ms", "computed tokens/request",
                "errors", "req/s vs round_robin"):
        table.add_column(col, justify="right")
    base = None
    for policy, runs in results.items():
        rps = statistics.median(o["n"] / o["wall_s"] for o in runs)
        base = base or rps
        table.add_row(policy, f"{rps:.2f}",
                      f"{statistics.median(_pct(o['ttft_s'], 0.5) for o in runs) * 1000:.0f}",
                      f"{statistics.median(_pct(o['ttft_s'], 0.99) for o in runs) * 1000:.0f}",
                      f"{statistics.median(o['computed'] for o in runs):.0f}",
                      str(sum(o["errors"] for o in runs)), f"{rps / base:.2f}")
    return table


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def serve_table(cluster, urls: dict[str, str], args) -> Table:
    results: dict[str, list[dict]] = {s: [] for s in SHAPES}
    for r in range(args.rounds):
        for i, shape in enumerate(SHAPES):
            prompts = _prompts(args.requests, seed=1000 * r + i)
            out = cluster.driver("d0", {"op": "load", "proxy": urls[shape], "prompts": prompts,
                                        "max_tokens": 32, "concurrency": args.concurrency})
            results[shape].append(out)
            console.print(f"round {r + 1} {shape}: {args.requests / out['wall_s']:.2f} req/s, "
                          f"TTFT p50 {_pct(out['ttft_s'], 0.5) * 1000:.0f} ms, "
                          f"{out['errors']} errors")
    table = Table(title=f"through the proxy: {args.requests} streams x {args.rounds} rounds, "
                        f"concurrency {args.concurrency} (medians of rounds)")
    for col in ("setup", "req/s", "TTFT p50 ms", "TTFT p99 ms", "errors", "req/s vs 1P1D"):
        table.add_column(col, justify="right")
    base = None
    for shape, runs in results.items():
        rps = statistics.median(args.requests / o["wall_s"] for o in runs)
        p50 = statistics.median(_pct(o["ttft_s"], 0.5) for o in runs) * 1000
        p99 = statistics.median(_pct(o["ttft_s"], 0.99) for o in runs) * 1000
        base = base or rps
        table.add_row(shape, f"{rps:.2f}", f"{p50:.0f}", f"{p99:.0f}",
                      str(sum(o["errors"] for o in runs)), f"{rps / base:.2f}")
    return table


def _in_rotation(cluster, url: str, node: str) -> bool | None:
    status = cluster.driver("d0", {"op": "ready", "proxy": url, "backends": 99,
                                   "wait_s": 0})["status"]
    for b in status.get("prefill", []) + status.get("decode", []):
        if b["url"] == node:
            return bool(b["in_rotation"])
    return None


def noticing(cluster, url: str) -> tuple[float, float]:
    """p1 frozen: seconds until out of rotation; thawed: until back in."""
    node = f"http://{cluster.hosts['p1'].ip}:8010"
    pid = cluster.services["p1/prefill-0"].proc.pid
    times = []
    for sig, want in ((signal.SIGSTOP, False), (signal.SIGCONT, True)):
        start = time.monotonic()
        os.killpg(pid, sig)
        while _in_rotation(cluster, url, node) is not want:
            if time.monotonic() - start > 60:
                raise RuntimeError(f"p1 not {'in' if want else 'out of'} rotation in 60 s")
            time.sleep(0.1)
        times.append(time.monotonic() - start)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-discovery", action="store_true")
    ap.add_argument("--skip-shapes", action="store_true",
                    help="only the routing table (and noticing)")
    args = ap.parse_args()
    model = tinymodel.build(MODEL_CACHE / "tiny", "tiny")
    out = Path(tempfile.mkdtemp(prefix="pd-xpyd-bench-"))
    with fabric(len(HOSTS)) as hosts:
        rendered = render(description(str(model), HOSTS, [h.ip for h in hosts]), out)
        by_name = {name: h for (name, _, _), h in zip(HOSTS, hosts, strict=True)}
        with bring_up(rendered, by_name, out / "logs") as cluster:
            took = wait_ready(cluster, "d0", f"http://{by_name['d0'].ip}:8000", 4)
            console.print(f"4 hosts up, every instance in rotation after {took:.0f} s")
            proxies, urls = [], {}
            for port, shape in enumerate(SHAPES, start=8101):
                proxies.append(_proxy(cluster, shape, port, out / "logs"))
                urls[shape] = f"http://{by_name['d0'].ip}:{port}"
            for port, policy in enumerate(POLICIES, start=8111):
                proxies.append(_proxy(cluster, policy, port, out / "logs", policy))
                urls[policy] = f"http://{by_name['d0'].ip}:{port}"
            try:
                for p in proxies:
                    p.start()
                for shape, url in urls.items():
                    wait_ready(cluster, "d0", url, sum(map(len, SHAPES.get(shape, ALL))))
                cluster.driver("d0", {"op": "load", "proxy": urls["1P1D"], "max_tokens": 8,
                                      "prompts": _prompts(8, seed=7), "concurrency": 4})
                if not args.skip_shapes:
                    Console().print(serve_table(cluster, urls, args))
                Console().print(routing_table(cluster, urls, args))
                out_s, in_s = noticing(cluster, urls["2P1D"])
                Console().print(f"health poll: a frozen P out of rotation after {out_s:.1f} "
                                f"s, back in {in_s:.1f} s after it thawed")
            finally:
                for p in proxies:
                    p.stop()
    if not args.skip_discovery:
        from discovery_latency import run as discovery_run

        Console().print(discovery_run())


if __name__ == "__main__":
    main()
