"""A soak: steady mixed load on the local node while a schedule of faults runs; what it lost.

    .venv/bin/python bench/soak.py [--minutes 15] [--concurrency 4] [--seed 1]
        [--faults d_killed,p_killed,p_frozen,link_reset,proxy_restarted] [--client-retries 2]
        [--log-dir DIR]

The node is `pdctl up --local`'s (the tiny model, keys on, P on CPU 0, D on CPU 1, split
`auto`), on free ports. The references come first, from one plain vLLM server of the same
model (greedy), which then stops. The load: `--concurrency` clients, each sending a seeded
mix of completions and chats, streamed and whole, and checking every answer against its
reference; a request no answer of which began (refused, its connection closed first) is
sent again up to twice, 0.5 s and 1 s later, as the OpenAI SDK's clients do by default
(`--client-retries`). The faults, spread evenly over the run (bench/soakfaults.py): D SIGKILLed and
restarted, P likewise, P frozen (SIGSTOP) 10 s, the side channel's TCP connections reset
(`ss -K`), the proxy restarted (SIGTERM: it drains, then starts again).

It prints requests sent, answered exactly, answered with another text, failed (by cause;
refused connections while no proxy listened apart), continued elsewhere (the proxy's
migrations), pulls received and recomputed on D, prompt tokens computed twice (P's and
D's computed prompt tokens less those of the prompts answered, each request with a
`cache_salt` of its own, as bench/churn.py counts them), each fault's recovery time (to
the restarted part back in rotation and a probe answered exactly), KV blocks held once
idle, and the proxy's memory after warm-up and at the end.
Counters are read every 2 s, so a restarted process's reset loses nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import soakfaults  # noqa: E402

from appliance import tinymodel  # noqa: E402
from appliance.localnode import LocalNode, NodeSpec  # noqa: E402
from appliance.pdctl.node.local import mooncake_port_env  # noqa: E402
from tests.conftest import free_port, running_plain_server  # noqa: E402

console = Console(stderr=True)
WORDS = ("river stone lamp quiet orbit maple signal harbor copper violet thunder garden "
         "pixel meadow anchor ember glacier lantern").split()


@dataclass(frozen=True)
class Item:
    """One request the load sends again and again, and the plain server's answer."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict
    reference: str = ""

    def with_stream(self, stream: bool, salt: str = "") -> dict:
        """The body to send; a stream asks for its usage, and a `cache_salt` of its own
        keeps each request's prompt from hitting the prefix cache (a recomputation shows in
        the prompt tokens computed)."""
        extra: dict = {"stream_options": {"include_usage": True}} if stream else {}
        return {**self.body, **extra, "stream": stream, **({"cache_salt": salt} if salt else {})}


def items(seed: int, n: int) -> list[Item]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 300)))
        common = {"model": "tiny", "temperature": 0, "max_tokens": rng.randint(8, 40)}
        if i % 2:
            out.append(Item("/v1/chat/completions",
                            {**common, "messages": [{"role": "user", "content": text}]}))
        else:
            out.append(Item("/v1/completions", {**common, "prompt": text}))
    return out


def answer(path: str, stream: bool, raw: str) -> tuple[str | None, int]:
    """(the answer's text, its prompt tokens); text None when it is no whole answer (an SSE
    error, no [DONE])."""
    chat = path.endswith("chat/completions")
    if not stream:
        whole = json.loads(raw)
        choice = whole["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return text, (whole.get("usage") or {}).get("prompt_tokens", 0)
    if not raw.endswith("data: [DONE]\n\n"):
        return None, 0
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    if any("error" in e for e in events):
        return None, 0
    usage = next((e["usage"] for e in events if e.get("usage")), {})
    return "".join((c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
                   for e in events for c in e.get("choices", [])), usage.get("prompt_tokens", 0)


@dataclass
class Outcome:
    started: float
    seconds: float
    # exact, other_text, http_<status>, broken_stream, refused, client_<exc> (no answer
    # began), cut_<exc> (the answer had begun)
    result: str
    stream: bool
    path: str
    prompt_tokens: int = 0
    retries: int = 0  # sent again after no answer began (refused, closed first)


# What the OpenAI SDK does by default (`max_retries=2`, 0.5 s then 1 s): a request with no
# answer begun (refused, or its connection closed first) is sent again.
CLIENT_RETRIES = 2
RETRY_AFTER_S = (0.5, 1.0)
_NO_ANSWER = ("refused", "client_ServerDisconnectedError", "client_ClientOSError")


async def send(http: aiohttp.ClientSession, url: str, item: Item, stream: bool,
               salt: str = "") -> tuple[str, int]:
    """(what came of it, the answer's prompt tokens)."""
    try:
        async with http.post(url + item.path, json=item.with_stream(stream, salt)) as r:
            try:
                raw = await r.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return f"cut_{type(exc).__name__}", 0  # its answer had begun
            if r.status != 200:
                return f"http_{r.status}", 0
    except aiohttp.ClientConnectorError:
        return "refused", 0  # nothing listened: the proxy between its stop and its start
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"client_{type(exc).__name__}", 0
    text, prompt_tokens = answer(item.path, stream, raw)
    if text is None:
        return "broken_stream", 0
    return ("exact" if text == item.reference else "other_text"), prompt_tokens


@dataclass
class Load:
    url: str
    work: list[Item]
    seed: int
    retries: int = CLIENT_RETRIES
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, concurrency: int, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, k, stop) for k in range(concurrency)))

    async def _client(self, http: aiohttp.ClientSession, k: int, stop: asyncio.Event) -> None:
        rng = random.Random(self.seed * 1000 + k)
        n = 0
        while not stop.is_set():
            item, stream = rng.choice(self.work), rng.random() < 0.5
            started = time.monotonic()
            n += 1
            retries = 0
            while True:
                result, tokens = await send(http, self.url, item, stream,
                                            f"{self.seed}-{k}-{n}")
                if result not in _NO_ANSWER or retries >= self.retries:
                    break
                await asyncio.sleep(RETRY_AFTER_S[min(retries, len(RETRY_AFTER_S) - 1)])
                retries += 1
            self.outcomes.append(Outcome(started, time.monotonic() - started, result, stream,
                                         item.path, tokens, retries))
            if result == "refused":
                await asyncio.sleep(0.2)  # a client's back-off, not a spin


async def references(model: Path, work: list[Item], log_dir: Path) -> list[Item]:
    with running_plain_server(model, "tiny", log_dir / "plain") as url:
        async with aiohttp.ClientSession() as http:
            out = []
            for item in work:
                async with http.post(url + item.path, json=item.with_stream(False)) as r:
                    text, _ = answer(item.path, False, await r.text())
                out.append(Item(item.path, item.body, text or ""))
    return out


def node_spec(model: Path, log_dir: Path) -> NodeSpec:
    """What `pdctl up --local` runs, on free ports."""
    return NodeSpec(model=model, served_model_name="tiny", prefill_port=free_port(),
                    decode_port=free_port(), bootstrap_port=free_port(),
                    proxy_port=free_port(), log_dir=log_dir / "node", secure=True,
                    extra_env=mooncake_port_env())


def report(load: Load, faults: list[soakfaults.Record], counts: dict[str, float],
           after: dict[str, float], minutes: float) -> dict:
    results: dict[str, int] = {}
    for o in load.outcomes:
        results[o.result] = results.get(o.result, 0) + 1
    retried = sum(1 for o in load.outcomes if o.retries)
    summary = {"minutes": minutes, "sent": len(load.outcomes), "results": results,
               "retried by the client": retried,
               "counters": counts, "faults": [f.__dict__ for f in faults], **after}
    table = Table(title=f"Soak: {minutes:g} min of mixed load on the local node, faults "
                        f"{', '.join(f.name for f in faults)}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("requests sent", str(len(load.outcomes)))
    for name in sorted(results):
        table.add_row(f"  {name}", str(results[name]))
    table.add_row("  of them sent again by the client (no answer had begun)", str(retried))
    for key, value in counts.items():
        table.add_row(key, f"{value:g}")
    for f in faults:
        table.add_row(f"recovery: {f.name}", f"{f.recovery_s:.1f} s" if f.recovery_s is not None
                      else f"not recovered ({f.note})")
    for key, value in after.items():
        table.add_row(key, str(value))
    Console(width=160).print(table)
    return summary


async def _index_blocks(http: aiohttp.ClientSession, url: str) -> int | None:
    """The blocks the proxy's prefix index holds, all engines together (None: unread)."""
    try:
        async with http.get(url + "/status") as r:
            prefix = (await r.json()).get("prefix") or {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return sum(rank["blocks"] for ranks in (prefix.get("nodes") or {}).values()
               for rank in ranks.values())


Sample = tuple[float, int, int, "int | None"]  # (time, proxy pid, RSS KiB, index blocks)


async def _sample_rss(node: LocalNode, out: list[Sample], stop: asyncio.Event) -> None:
    """Every 5 s, the proxy's RSS and its prefix index's size: the index mirrors what the
    engines cache, so it grows until their caches are full, then stays (bounded by them)."""
    url = node.spec.proxy_url or ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while not stop.is_set():
            proc = node.proxy.proc if node.proxy is not None else None
            try:
                if proc is not None and proc.poll() is None:
                    kib = soakfaults.rss_kib(node.proxy)
                    out.append((time.monotonic(), proc.pid, kib,
                                await _index_blocks(http, url)))
            except (OSError, StopIteration):
                pass  # between its stop and its start
            try:
                await asyncio.wait_for(stop.wait(), 5.0)
            except asyncio.TimeoutError:
                pass


def growth(samples: list[Sample]) -> str:
    """The first proxy's RSS at its end over its RSS a quarter into its life (past its
    warm-up: caches, histograms filled), as a percentage, with its prefix index's blocks at
    both times (the index grows with what the engines cache, up to their capacity)."""
    if not samples:
        return "-"
    first = [(t, kib, blocks) for t, pid, kib, blocks in samples if pid == samples[0][1]]
    t0, t1 = first[0][0], first[-1][0]
    _, quarter, q_blocks = next(x for x in first if x[0] >= t0 + (t1 - t0) / 4)
    _, end, e_blocks = first[-1]
    return (f"{quarter} -> {end} KiB ({end / quarter - 1:+.1%}); "
            f"index {q_blocks} -> {e_blocks} blocks")


async def soak(args: argparse.Namespace) -> dict:
    model = tinymodel.build(ROOT / ".cache" / "models" / "tiny", "tiny")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    console.log("references from a plain vLLM server")
    work = await references(model, items(args.seed, args.prompts), args.log_dir)
    node = LocalNode(node_spec(model, args.log_dir))
    console.log(f"starting the local node (logs in {node.spec.log_dir})")
    node.start()
    try:
        scrape = soakfaults.Counters(node)
        url = node.spec.proxy_url or ""
        stop = asyncio.Event()
        load = Load(url, work, args.seed, args.client_retries)
        await asyncio.to_thread(scrape.poll)
        warm = Load(url, work, args.seed + 1)
        warm_stop = asyncio.Event()
        asyncio.get_running_loop().call_later(20, warm_stop.set)
        await warm.run(args.concurrency, warm_stop)  # warm-up: not counted
        rss_start = soakfaults.rss_kib(node.proxy)
        await asyncio.to_thread(scrape.poll)
        baseline = dict(scrape.totals)
        scraping = asyncio.create_task(scrape.every(2.0, stop))
        rss: list[Sample] = []
        sampling = asyncio.create_task(_sample_rss(node, rss, stop))
        running = asyncio.create_task(load.run(args.concurrency, stop))
        schedule = soakfaults.schedule([f for f in args.faults.split(",") if f])
        gap = args.minutes * 60 / (len(schedule) + 1)
        records = []

        async def probe(http: aiohttp.ClientSession) -> bool:
            return (await send(http, url, work[0], False))[0] == "exact"

        begin = time.monotonic()
        for k, fault in enumerate(schedule):
            await asyncio.sleep(max(0.0, begin + gap * (k + 1) - time.monotonic()))
            console.log(f"fault: {fault.name}")
            records.append(await fault.run(node, probe))
            console.log(f"  {records[-1]}")
        await asyncio.sleep(max(0.0, begin + args.minutes * 60 - time.monotonic()))
        stop.set()
        await running
        await scraping
        await sampling
        await asyncio.to_thread(scrape.poll)
        counts = {k: v - baseline.get(k, 0.0) for k, v in scrape.totals.items()}
        answered = sum(o.prompt_tokens for o in load.outcomes)
        counts["prompt tokens answered"] = answered
        # Each request's prompt is computed once (a salt of its own: no cache hit) unless a
        # pull failed or an engine died under it; a killed engine never reports what it had
        # not finished, so this may read low around a kill (bench/churn.py's measure).
        counts["prompt tokens computed twice"] = (counts["prompt tokens computed on P"]
                                                  + counts["prompt tokens computed on D"]
                                                  - answered)
        held = await soakfaults.blocks_held_when_idle(node, within=60)
        after = {"KV usage once idle (P, D)": held,
                 "proxy RSS after warm-up KiB": rss_start,
                 "proxy RSS before its restart KiB": soakfaults.PROXY_RSS_BEFORE_RESTART[:1],
                 "proxy RSS at the end KiB": soakfaults.rss_kib(node.proxy),
                 "first proxy's RSS growth, a quarter of its life to its end": growth(rss),
                 "proxy restarted meanwhile": "proxy_restarted" in args.faults}
        summary = report(load, records, counts, after, args.minutes)
        summary["proxy RSS samples (s, pid, KiB, index blocks)"] = [
            (round(t - begin, 1), pid, kib, blocks) for t, pid, kib, blocks in rss]
        return summary
    finally:
        node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=24, help="distinct requests in the mix")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--client-retries", type=int, default=CLIENT_RETRIES,
                        help="times a client sends a request again when no answer began "
                             "(refused, closed first), as the OpenAI SDK does (0: never)")
    parser.add_argument("--faults", default=",".join(soakfaults.FAULTS))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pd-bench-soak"))
    args = parser.parse_args()
    unknown = {f for f in args.faults.split(",") if f} - set(soakfaults.FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(soakfaults.FAULTS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary = asyncio.run(soak(args))
    out = args.log_dir / f"soak-{args.seed}.json"
    out.write_text(json.dumps(summary, indent=1))
    console.log(f"kept as {out}")


if __name__ == "__main__":
    main()
