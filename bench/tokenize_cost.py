"""What the prefix index's tokenization costs a request: vLLM's /tokenize on a node (what the
proxy does) against a tokenizer in the proxy's own process, and against the prefill the
prediction is for, in one run on one plain server of the model (core 0).

    .venv/bin/python bench/tokenize_cost.py [--model tiny|kvbench] [--calls 50]

Each row: the median over `calls` of /tokenize through a kept-alive aiohttp session, of the
`tokenizers` package encoding the same text in process (completions only: a chat's template
is vLLM's), and of the prompt's prefill (a distinct prompt each time, max_tokens 1).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ttft import SERVED, serve  # noqa: E402

from appliance import tinymodel  # noqa: E402
from tests.conftest import MODEL_CACHE, free_port  # noqa: E402

WORDS = ("prefill decode cache block token layer head model server request response stream "
         "proxy the a of and to in").split()


def _text(chars: int, rng: random.Random) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


async def _median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _sync_median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


async def run(url: str, model: Path, calls: int) -> Table:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(7)
    table = Table(title=f"tokenizing a prompt vs prefilling it ({model.name}, medians of "
                        f"{calls})")
    for col in ("prompt", "tokens", "/tokenize ms", "in process ms", "prefill ms",
                "/tokenize / prefill"):
        table.add_column(col, justify="right")
    async with aiohttp.ClientSession() as http:
        async def post(path: str, body: dict) -> dict:
            async with http.post(url + path, json=body) as r:
                return await r.json()
        for chars in (512, 2048, 8192):
            text = _text(chars, rng)
            for kind in ("completion", "chat"):
                what = ({"model": SERVED, "prompt": text} if kind == "completion" else
                        {"model": SERVED, "messages": [{"role": "user", "content": text}]})
                tokens = (await post("/tokenize", what))["count"]
                remote = await _median_ms(lambda w=what: post("/tokenize", w), calls)
                local = _sync_median_ms(lambda t=text: tok.encode(t), calls) \
                    if kind == "completion" else None

                async def prefill(t: str = text) -> None:
                    await post("/v1/completions", {"model": SERVED, "max_tokens": 1,
                                                   "prompt": f"{rng.random()} {t}"})
                fill = await _median_ms(prefill, max(3, calls // 10))
                table.add_row(f"{kind}, {chars} chars", str(tokens), f"{remote:.2f}",
                              "-" if local is None else f"{local:.2f}", f"{fill:.1f}",
                              f"{remote / fill:.3f}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "kvbench"])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    model = tinymodel.build(MODEL_CACHE / args.model, args.model)
    port = free_port()
    svc = serve("plain", model, port, (0,), Path(tempfile.mkdtemp(prefix="pd-tokenize-")))
    svc.start()
    try:
        svc.wait_healthy(400)
        Console().print(asyncio.run(run(f"http://127.0.0.1:{port}", model, args.calls)))
    finally:
        svc.stop()


if __name__ == "__main__":
    main()
