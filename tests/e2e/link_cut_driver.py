"""Runs inside the decode host's network namespace, where the proxy runs too: requests
through the proxy, the P-D link (this side's veth) cut while P's slowed writes are under
way, then restored. Prints one JSON line: each answer (status, text, seconds), how many D
calls were asked again alone, and whether P's KV serves again afterwards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import aiohttp

from tests.e2e.observe import kv_usage, metric


def _wait(check, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def _in_rotation(proxy: str) -> bool:
    try:
        status = json.load(urllib.request.urlopen(proxy + "/status", timeout=5))
    except OSError:
        return False
    return all(b["in_rotation"] for b in status["prefill"] + status["decode"])


async def _ask(http: aiohttp.ClientSession, proxy: str, body: dict) -> list:
    started = time.monotonic()
    async with http.post(proxy + "/v1/completions", json=body) as r:
        raw = await r.text()
    took = time.monotonic() - started
    if r.status != 200:
        return [r.status, raw[:300], took]
    return [200, json.loads(raw)["choices"][0]["text"], took]


async def main(args: dict) -> None:
    proxy, dev = args["proxy"], args["dev"]
    _wait(lambda: _in_rotation(proxy), args["timeout"], "the proxy's nodes")
    prefill_down = 'pd_proxy_prefill_fallbacks_total{reason="prefill_down"}'
    out: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        done = metric(proxy, "pd_proxy_prefill_seconds_count")
        bodies = [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0}
                  for p in args["prompts"]]
        asks = [asyncio.create_task(_ask(http, proxy, b)) for b in bodies]
        while metric(proxy, "pd_proxy_prefill_seconds_count") < done + len(bodies):
            await asyncio.sleep(0.05)
        subprocess.run(["ip", "link", "set", dev, "down"], check=True)
        cut = time.monotonic()
        out["answers"] = await asyncio.gather(*asks)
        out["cut_s"] = time.monotonic() - cut
        out["moved"] = metric(proxy, prefill_down)
        subprocess.run(["ip", "link", "set", dev, "up"], check=True)
        restored = time.monotonic()
        _wait(lambda: _in_rotation(proxy), 60, "P back in rotation")
        out["recovered_s"] = time.monotonic() - restored
        fallbacks = metric(proxy, "pd_proxy_prefill_fallbacks_total")
        out["after"] = await _ask(http, proxy, bodies[0])
        out["after_from_p"] = metric(proxy, "pd_proxy_prefill_fallbacks_total") == fallbacks
    # Nothing held on either host once the abandoned transfers are settled.
    freed = time.monotonic()
    _wait(lambda: kv_usage(args["prefill"]) == kv_usage(args["decode"]) == 0, 90,
          "no blocks held")
    out["freed_s"] = time.monotonic() - freed
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
