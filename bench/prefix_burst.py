"""Bursts of prompts on shared prefixes at a D that chunks its prefills: what the
connector's wait for a prefix another request computes (`shared_prefix_wait`,
appliance.connector.prefixwait) saves, against vLLM's own scheduling of the same engine
(the setting off), in one run (real vLLM, CPU build, Mooncake not involved: D computes).

    .venv/bin/python bench/prefix_burst.py [--model kvbench] [--bursts AABB,ABAB,AAAB,AB]
                                           [--rounds 3] [--prefix 768] [--suffix 128]

Two D engines with the CPU stack's prefill chunk (decode_prefill_chunk), one with the wait
and one without, both on CPU 1; they take turns. Each burst sends one prompt per letter at
once, a letter naming a new prefix of `--prefix` tokens, each prompt with `--suffix`
tokens of its own, 32 tokens out. Printed per burst: the prompt tokens each engine
computed (its prefix cache's queries less its hits) and the time to the burst's last
answer, medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ttft import SERVED, SETTLE_S, serve  # noqa: E402

from appliance import tinymodel  # noqa: E402
from appliance.process import DECODE_PREFILL_CHUNK, decode_chunk_flags  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.e2e.observe import metric  # noqa: E402

console = Console(stderr=True)
SETUPS = {"wait": True, "vllm": False}


def consumer(wait: bool) -> dict:
    return {"kv_connector": "PDConnector", "kv_connector_module_path": "appliance.connector.facade",
            "kv_role": "kv_consumer", "engine_id": "d0", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"protocol": "tcp", "host": "127.0.0.1",
                                          "shared_prefix_wait": wait}}


def computed(url: str) -> float:
    return (metric(url, "vllm:prefix_cache_queries_total")
            - metric(url, "vllm:prefix_cache_hits_total"))


async def burst(url: str, letters: str, rng: random.Random, prefix: int,
                suffix: int) -> tuple[float, float]:
    """(tokens computed, seconds to the last answer) of one burst on new prefixes."""
    prefixes = {k: [rng.randrange(3, 2000) for _ in range(prefix)] for k in set(letters)}
    before = computed(url)
    async with aiohttp.ClientSession() as http:
        async def one(letter: str) -> None:
            prompt = prefixes[letter] + [rng.randrange(3, 2000) for _ in range(suffix)]
            async with http.post(url + "/v1/completions", json={
                    "model": SERVED, "prompt": prompt, "max_tokens": 32,
                    "ignore_eos": True, "temperature": 0}) as r:
                assert r.status == 200, await r.text()
        started = time.monotonic()
        await asyncio.gather(*(one(k) for k in letters))
        took = time.monotonic() - started
    return computed(url) - before, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kvbench")
    parser.add_argument("--bursts", default="AABB,ABAB,AAAB,AB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=768)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pd-bench-prefix-burst"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model = tinymodel.build(ROOT / ".cache" / "models" / args.model, args.model)
    chunk = decode_chunk_flags(DECODE_PREFILL_CHUNK["cpu"])
    urls: dict[str, str] = {}
    services = []
    try:
        for name, wait in SETUPS.items():
            port = free_port()
            svc = serve(f"burst-{name}", model, port, (1,), args.log_dir, consumer(wait),
                        args=chunk)
            svc.start()
            services.append(svc)
            urls[name] = f"http://127.0.0.1:{port}"
        for svc in services:
            svc.wait_healthy(400)
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for url in urls.values():  # warm-up: the first prompts of an engine are slow
            asyncio.run(burst(url, "AB", random.Random(0), args.prefix, args.suffix))
        for rnd in range(args.rounds):
            for letters in args.bursts.split(","):
                order = list(urls) if rnd % 2 == 0 else list(reversed(urls))
                for name in order:
                    time.sleep(SETTLE_S)
                    # The same prompts for both setups in a round.
                    rng = random.Random(f"{rnd}-{letters}")
                    got = asyncio.run(burst(urls[name], letters, rng, args.prefix, args.suffix))
                    console.log(f"round {rnd + 1}, {letters}, {name}: computed {got[0]:.0f}, "
                                f"{got[1]:.2f} s")
                    results.setdefault((letters, name), []).append(got)
    finally:
        for svc in reversed(services):
            svc.stop()
    table = Table(title=f"bursts on new prefixes at one D ({args.model}, prefix {args.prefix}"
                        f" + {args.suffix} own tokens, chunk {DECODE_PREFILL_CHUNK['cpu']}); "
                        f"medians of {args.rounds} rounds")
    for col in ("burst", "computed, wait", "computed, vLLM", "last answer s, wait",
                "last answer s, vLLM", "wait / vLLM"):
        table.add_column(col, justify="right")
    for letters in args.bursts.split(","):
        w, v = results[(letters, "wait")], results[(letters, "vllm")]
        wt, vt = (statistics.median(t for _, t in r) for r in (w, v))
        table.add_row(letters, f"{statistics.median(c for c, _ in w):.0f}",
                      f"{statistics.median(c for c, _ in v):.0f}", f"{wt:.2f}", f"{vt:.2f}",
                      f"{wt / vt:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
