"""Runs inside a cluster host's namespace: the client side of the xPyD tests.

    {"op": "ready", "proxy": URL, "backends": N, "wait_s": S}
        -> {"ready": bool, "status": the proxy's /status}
    {"op": "ask", "proxy": URL, "prompts": [...], "max_tokens": N, "concurrency": C}
        -> {"answers": [[status, token ids or error text, seconds], ...]}
    {"op": "load", "proxy": URL, "prompts": [...], "max_tokens": N, "concurrency": C}
        -> {"wall_s": S, "ttft_s": [...], "errors": N}   (streams; bench/xpyd.py; "prompts"
        may be "prompts_file": a JSON file of them, for more than one argument holds)
    {"op": "metrics", "urls": [...], "series": [...]}
        -> {"sums": {url: {series: sum over its labels}}}   (bench/xpyd.py)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp


async def _status(http: aiohttp.ClientSession, proxy: str) -> dict:
    try:
        async with http.get(f"{proxy}/status", timeout=aiohttp.ClientTimeout(total=3)) as r:
            return await r.json() if r.status == 200 else {"http": r.status}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"error": str(exc) or type(exc).__name__}


def _in_rotation(status: dict) -> int:
    return sum(1 for role in ("prefill", "decode") for b in status.get(role) or []
               if b.get("in_rotation"))


async def ready(args: dict) -> dict:
    deadline = time.monotonic() + args["wait_s"]
    async with aiohttp.ClientSession() as http:
        while True:
            status = await _status(http, args["proxy"])
            if _in_rotation(status) >= args["backends"]:
                return {"ready": True, "status": status}
            if time.monotonic() > deadline:
                return {"ready": False, "status": status}
            await asyncio.sleep(0.3)


async def ask(args: dict) -> dict:
    gate = asyncio.Semaphore(args.get("concurrency", 1))

    async def one(http: aiohttp.ClientSession, prompt: list[int]) -> list:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": args["max_tokens"],
                "temperature": 0, "return_token_ids": True}
        async with gate:
            start = time.monotonic()
            try:
                async with http.post(f"{args['proxy']}/v1/completions", json=body) as r:
                    data = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return [0, f"client: {exc or type(exc).__name__}", time.monotonic() - start]
            took = time.monotonic() - start
            if r.status == 200:
                return [200, data["choices"][0]["token_ids"], took]
            return [r.status, (data.get("error") or {}).get("message", str(data)), took]

    timeout = aiohttp.ClientTimeout(total=args.get("timeout", 300))
    async with aiohttp.ClientSession(timeout=timeout) as http:
        print("sending", file=sys.stderr, flush=True)  # a test may act on this moment
        answers = await asyncio.gather(*(one(http, p) for p in args["prompts"]))
    return {"answers": answers}


async def load(args: dict) -> dict:
    """Streaming requests through the proxy: each one's time to its first token."""
    gate = asyncio.Semaphore(args["concurrency"])
    ttfts: list[float] = []
    errors = 0

    async def one(http: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal errors
        body = {"model": "tiny", "prompt": prompt, "max_tokens": args["max_tokens"],
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with gate:
            start = time.monotonic()
            first = None
            try:
                async with http.post(f"{args['proxy']}/v1/completions", json=body) as r:
                    if r.status != 200:
                        errors += 1
                        return
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.monotonic() - start
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1
                return
            if first is None:
                errors += 1
            else:
                ttfts.append(first)

    prompts = args.get("prompts") or json.loads(Path(args["prompts_file"]).read_text())
    timeout = aiohttp.ClientTimeout(total=args.get("timeout", 600))
    async with aiohttp.ClientSession(timeout=timeout) as http:
        start = time.monotonic()
        await asyncio.gather(*(one(http, p) for p in prompts))
        wall = time.monotonic() - start
    return {"wall_s": wall, "ttft_s": ttfts, "errors": errors}


async def metrics(args: dict) -> dict:
    sums: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as http:
        for url in args["urls"]:
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
            sums[url] = {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                   if line.startswith((name + "{", name + " ")))
                         for name in args["series"]}
    return {"sums": sums}


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    op = {"ready": ready, "ask": ask, "load": load, "metrics": metrics}[request["op"]]
    print(json.dumps(asyncio.run(op(request))))
