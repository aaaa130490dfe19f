"""The multi-turn workload of bench/serve.py: conversations where each turn's prompt is the
whole conversation so far (the last prompt, its answer, a new message), several in flight.
Token-id prompts (completions API, greedy, `ignore_eos`), so every setup sees the same
tokens and a turn's prefix is exactly the last turn's prompt and answer: what prefix
caching, and a D that keeps the KV it received, can save.

Results use `vllm bench serve`'s keys (turns count as requests; TPOT and ITL from the
streamed tokens' arrival times). `run` keeps a fixed number of conversations in flight;
`run_open` starts them at Poisson arrivals and returns each turn's numbers as
`vllm bench serve --save-detailed` does (bench/goodput.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import aiohttp

FIRST, EACH, OUT = 512, 96, 32  # tokens: the first message, each later one, each answer


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _turn(http: aiohttp.ClientSession, url: str, model: str,
                prompt: list[int]) -> tuple[float, list[float], list[int]]:
    """(TTFT, inter-token gaps, the answer's token ids) of one streamed turn."""
    started = time.monotonic()
    arrivals: list[float] = []
    answer: list[int] = []
    async with http.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            ids = choices[0].get("token_ids") or []
            if ids or choices[0].get("text"):
                arrivals.append(time.monotonic())
                answer += ids
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return arrivals[0] - started, gaps, answer


async def _conversation(http: aiohttp.ClientSession, url: str, model: str, rng: random.Random,
                        turns: int, out: dict[str, list[float]]) -> None:
    prompt = [rng.randrange(3, 2000) for _ in range(FIRST)]
    for turn in range(turns):
        ttft, gaps, answer = await _turn(http, url, model, prompt)
        out["ttft"].append(ttft)
        out["ttft_first" if turn == 0 else "ttft_later"].append(ttft)
        out["itl"] += gaps
        if gaps:
            out["tpot"].append(sum(gaps) / len(gaps))
        # Without ids in the stream the history still grows, though not by the answer.
        prompt = prompt + (answer or [rng.randrange(3, 2000) for _ in range(OUT)]) + \
            [rng.randrange(3, 2000) for _ in range(EACH)]


def run(url: str, model: str, seed: int, conversations: int = 8, turns: int = 4,
        quick: bool = False) -> dict[str, float]:
    if quick:  # a quarter of the turns, each conversation whole: the workload's mix of
        # first turns (long) and later ones (mostly cached), which auto learns from
        conversations = max(1, conversations // 4)
    # TTFT also apart for first turns (the whole prompt is new) and later ones (mostly
    # cached where the conversation ran).
    out: dict[str, list[float]] = {"ttft": [], "itl": [], "tpot": [], "ttft_first": [],
                                   "ttft_later": []}

    async def main() -> float:
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            started = time.monotonic()
            await asyncio.gather(*(_conversation(http, url, model, random.Random(seed * 100 + c),
                                                 turns, out) for c in range(conversations)))
            return time.monotonic() - started

    took = asyncio.run(main())
    result: dict[str, float] = {"completed": len(out["ttft"]),
                                "request_throughput": len(out["ttft"]) / took}
    for metric, values in out.items():
        result[f"p50_{metric}_ms"] = statistics.median(values) * 1000 if values \
            else float("nan")
        result[f"p99_{metric}_ms"] = _pct(values, 0.99) * 1000
    return result


async def _open_conversation(http: aiohttp.ClientSession, url: str, model: str, seed: int,
                             delay: float, turns: int, out: dict[str, list]) -> None:
    await asyncio.sleep(delay)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 2000) for _ in range(FIRST)]
    for _ in range(turns):
        try:
            ttft, gaps, answer = await _turn(http, url, model, prompt)
        except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError) as e:
            # The conversation ends here; its remaining turns count as failed too.
            out["ttfts"] += [0.0] * turns
            out["itls"] += [[]] * turns
            out["errors"] += [f"{type(e).__name__}: {e}"[:200]] * turns
            return
        out["ttfts"].append(ttft)
        out["itls"].append(gaps)
        out["errors"].append("")
        turns -= 1
        prompt = prompt + answer + [rng.randrange(3, 2000) for _ in range(EACH)]


def run_open(url: str, model: str, seed: int, rate: float, conversations: int,
             turns: int = 4) -> dict:
    """Conversations arriving as a Poisson process of `rate` turns per second in all (one
    conversation every turns/rate seconds on average), each turn sent when the last one's
    answer ended: {"ttfts", "itls", "errors", "completed", "request_throughput"}."""
    arrivals, t, rng = [], 0.0, random.Random(seed)
    for _ in range(conversations):
        arrivals.append(t)
        t += rng.expovariate(rate / turns)
    out: dict[str, list] = {"ttfts": [], "itls": [], "errors": []}

    async def main() -> float:
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            started = time.monotonic()
            await asyncio.gather(*(_open_conversation(http, url, model, seed * 100 + c, delay,
                                                      turns, out)
                                   for c, delay in enumerate(arrivals)))
            return time.monotonic() - started

    took = asyncio.run(main())
    completed = sum(1 for e in out["errors"] if not e)
    return {**out, "completed": completed, "request_throughput": completed / took}
