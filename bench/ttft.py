"""Time to first token through P→D vs one plain vLLM server, and vs vLLM's built-in
MooncakeConnector as the peer, all measured in this one run (real vLLM, CPU build,
Mooncake over TCP loopback, the larger-KV tiny model: 48 KiB of KV per token).

    .venv/bin/python bench/ttft.py [--sizes 128,512,2000] [--repeats 5] [--concurrency 1,4]
        [--compare-late] [--compare-immediate] [--skip-builtin] [--skip-appliance]
        [--model kvbench|mla]

Setups: "ours" and "builtin" are driven the way vLLM's example proxy drives a connector (P
and D at once, D gives the first token); "appliance" is our proxy in front of ours' servers
(P's token goes to the client at once, D continues after it). The second table (time to
the second token) shows what the early first token costs the next one.

Every setup is up at once (P pinned to CPU 0, D to CPU 1; the plain server to CPU 0; an
idle server's workers stop polling a second after their last step) and they take turns on
the same fresh prompts, round by round, so no prefix cache helps and drift on this shared
machine hits all alike. Added TTFT = setup's
median TTFT minus the plain server's at the same size and concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gitref import checkout  # noqa: E402

from appliance import tinymodel  # noqa: E402
from appliance.process import (  # noqa: E402
    CPU_BLOCK_SIZE,
    DECODE_PREFILL_CHUNK,
    ENGINE_STEP_TOKENS,
    KV_EVENTS_FLAGS,
    ServiceProcess,
    cpu_env,
    decode_chunk_flags,
    step_tokens_flags,
    vllm_serve_argv,
)
from appliance.proxy.exchange.bodies import decode_body, prefill_body  # noqa: E402
from appliance.proxy.openai_api import COMPLETIONS  # noqa: E402
from appliance.proxy.prefix.tokenizer import folder_of  # noqa: E402
from tests.conftest import free_port  # noqa: E402

KV_BYTES = str(512 * 2**20)  # room for 4 concurrent 2,000-token prompts of 48 KiB/token
FLAGS = ("--enforce-eager", "--kv-cache-memory-bytes", KV_BYTES)
# vLLM's workers busy-poll for 1 s after their last step; wait that out between turns so
# one setup's idle servers never compete with the next setup's measurement.
SETTLE_S = 1.5
SERVED = "bench"  # the served model name, whichever tiny model runs
console = Console(stderr=True)


@dataclass
class Setup:
    name: str
    services: list[ServiceProcess]
    prefill_url: str | None = None
    decode_url: str | None = None
    bootstrap_url: str | None = None
    engine_id: str | None = None
    plain_url: str | None = None
    proxy_url: str | None = None  # requests go through the appliance's proxy

    def start(self) -> None:
        for svc in self.services:
            svc.start()
        try:
            for svc in self.services:
                svc.wait_healthy(400)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop()


def serve(name: str, model: Path, port: int, cpus: tuple[int, ...], log_dir: Path,
          kv_config: dict | None = None, env: dict | None = None,
          args: tuple[str, ...] = ()) -> ServiceProcess:
    # The appliance's P and D publish KV events for the proxy's prefix index, as pdctl's do.
    events = KV_EVENTS_FLAGS if kv_config and kv_config["kv_connector"] == "PDConnector" else ()
    argv = vllm_serve_argv(model, port, served_model_name=SERVED, block_size=CPU_BLOCK_SIZE,
                           max_model_len=4096,
                           extra=(*FLAGS, *tinymodel.spec_of(model).serve_args, *events,
                                  *args),
                           kv_transfer_config=json.dumps(kv_config) if kv_config else None)
    return ServiceProcess(name, argv, log_dir / f"{name}.log",
                          env={**cpu_env(",".join(map(str, cpus))), **(env or {})},
                          health_url=f"http://127.0.0.1:{port}/health", cpus=cpus)


def plain_setup(model: Path, log_dir: Path) -> Setup:
    port = free_port()
    return Setup("plain", [serve("plain", model, port, (0,), log_dir)],
                 plain_url=f"http://127.0.0.1:{port}")


def ours_setup(model: Path, log_dir: Path, early_push: bool = True,
               cpu_push_delay_ms: float | None = None, name: str | None = None,
               code: Path | None = None, extra: dict | None = None,
               decode_chunk: int = 0, engine_args: tuple[str, ...] = ()) -> Setup:
    """`code`: a checkout whose appliance package the setup's processes import instead
    (ours at another commit, for a before/after in one run); `extra`: more of the
    connector's settings; `decode_chunk`: D's longest prefill chunk while others run
    (appliance.process.decode_chunk_flags); `engine_args`: more flags for both engines."""
    env = {"PYTHONPATH": str(code)} if code is not None else None
    bport, pport, dport = free_port(), free_port(), free_port()
    if name is None:
        name = "ours" if early_push else "ours-late"
    if cpu_push_delay_ms is not None:
        name = f"ours-delay{cpu_push_delay_ms:g}"
    boot = ServiceProcess("bootstrap", [sys.executable, "-m", "appliance.bootstrap", "--host",
                                        "127.0.0.1", "--port", str(bport), "--no-token"],
                          log_dir / f"{name}-bootstrap.log", env=env or {},
                          health_url=f"http://127.0.0.1:{bport}/health")

    def cfg(role: str, engine: str) -> dict:
        return {"kv_connector": "PDConnector",
                "kv_connector_module_path": "appliance.connector.facade",
                "kv_role": role, "engine_id": engine, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"bootstrap_addr": f"http://127.0.0.1:{bport}",
                                              "protocol": "tcp", "host": "127.0.0.1",
                                              "early_push": early_push,
                                              **({"cpu_push_delay_ms": cpu_push_delay_ms}
                                                 if cpu_push_delay_ms is not None else {}),
                                              **(extra or {})}}
    services = [boot, serve(f"{name}-p", model, pport, (0,), log_dir, cfg("kv_producer", "p0"),
                            env, engine_args),
                serve(f"{name}-d", model, dport, (1,), log_dir, cfg("kv_consumer", "d0"), env,
                      (*decode_chunk_flags(decode_chunk), *engine_args))]
    if code is not None:
        for svc in services:  # the working directory comes first on sys.path
            svc.cwd = code
    return Setup(name, services,
                 prefill_url=f"http://127.0.0.1:{pport}", decode_url=f"http://127.0.0.1:{dport}",
                 bootstrap_url=f"http://127.0.0.1:{bport}", engine_id="p0")


def appliance_setup(model: Path, log_dir: Path, split: str = "always",
                    name: str = "appliance", log_requests: bool = False,
                    tokenizer: bool = True,
                    decode_chunk: int = DECODE_PREFILL_CHUNK["cpu"],
                    step_tokens: int = ENGINE_STEP_TOKENS["cpu"]) -> Setup:
    """The appliance as users meet it: our proxy (P's token first) in front of a P and D of
    its own (shared servers would see each prompt twice: a prefix-cache hit). `split`:
    the proxy's placement policy (always: every request through P, as this benchmark
    measures); `log_requests`: the proxy's access lines in its log; `tokenizer`: the proxy
    tokenizes prompts itself, as `pdctl up --local` has it (else it asks D's /tokenize);
    `decode_chunk`: D's prefill chunk, `step_tokens`: each engine's token budget per step
    (the CPU stack's defaults)."""
    servers = ours_setup(model, log_dir, name=name, decode_chunk=decode_chunk,
                         engine_args=step_tokens_flags(step_tokens))
    folder = folder_of(str(model)) if tokenizer else None
    port = free_port()
    proxy = ServiceProcess(
        f"{name}-proxy", [sys.executable, "-m", "appliance.proxy", "--host", "127.0.0.1",
                          "--port", str(port), "--prefill",
                          f"{servers.prefill_url},{servers.bootstrap_url}",
                          "--decode", str(servers.decode_url), "--split", split,
                          *(("--tokenizer", folder) if folder else ()),
                          "--kv-block-size", str(CPU_BLOCK_SIZE),
                          *(() if log_requests else ("--no-log-requests",))],
        log_dir / f"{name}-proxy.log", health_url=f"http://127.0.0.1:{port}/health")
    return Setup(name, [*servers.services, proxy], proxy_url=f"http://127.0.0.1:{port}",
                 prefill_url=servers.prefill_url, decode_url=servers.decode_url)


def builtin_setup(model: Path, log_dir: Path) -> Setup:
    bport, pport, dport = free_port(), free_port(), free_port()
    env = {"PD_PATCH_ACCELERATOR_INDEX": "1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bport)}

    def cfg(role: str) -> dict:
        return {"kv_connector": "MooncakeConnector", "kv_role": role,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    return Setup("builtin", [serve("builtin-p", model, pport, (0,), log_dir,
                                   cfg("kv_producer"), env),
                             serve("builtin-d", model, dport, (1,), log_dir,
                                   cfg("kv_consumer"), env)],
                 prefill_url=f"http://127.0.0.1:{pport}", decode_url=f"http://127.0.0.1:{dport}",
                 bootstrap_url=f"http://127.0.0.1:{bport}")


async def discover_engine(setup: Setup) -> None:
    if setup.engine_id or not setup.bootstrap_url:
        return
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            try:
                async with http.get(setup.bootstrap_url + "/query") as r:
                    data = await r.json()
                    if data:
                        setup.engine_id = data["0"]["engine_id"]
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{setup.name}: the prefill engine never registered")


Times = tuple[float, float]  # seconds to the first token, and to the second


async def token_seconds(http: aiohttp.ClientSession, url: str, body: dict) -> Times:
    start = time.perf_counter()
    seen: list[float] = []
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"text"' in line and len(seen) < 2:
                seen.append(time.perf_counter() - start)
    if len(seen) < 2:
        raise RuntimeError(f"stream ended after {len(seen)} token(s)")
    return seen[0], seen[1]


async def one_request(http: aiohttp.ClientSession, setup: Setup, prompt: list[int]) -> Times:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}
    if setup.plain_url or setup.proxy_url:
        return await token_seconds(http, setup.plain_url or setup.proxy_url, body)
    tid = f"xfer-{uuid.uuid4()}"
    p_body = prefill_body(body, COMPLETIONS, tid)
    d_body = decode_body(body, tid, setup.bootstrap_url, setup.engine_id)

    async def prefill() -> None:
        async with http.post(setup.prefill_url + "/v1/completions", json=p_body) as r:
            assert r.status == 200, await r.text()
            await r.read()
    p_task = asyncio.create_task(prefill())
    times = await token_seconds(http, setup.decode_url, d_body)
    await p_task
    return times


async def measure(setups: list[Setup], sizes: list[int], concurrency: list[int],
                  repeats: int, seed: int, request_timeout: float
                  ) -> tuple[dict[str, dict[tuple[int, int], Times]],
                             dict[str, dict[tuple[int, int], int]]]:
    """Median times to the first and the second token per setup and (size, concurrency),
    and how many requests got no first token within request_timeout (a stuck transfer).

    Every setup is up at once and they take turns, round by round, on the same prompts,
    the order rotating each round: a noisy neighbour or a slow minute on this shared
    machine hits every setup alike instead of whichever happened to run then.
    """
    rng = random.Random(seed)
    samples: dict[str, dict[tuple[int, int], list[Times]]] = {s.name: {} for s in setups}
    stuck: dict[str, dict[tuple[int, int], int]] = {s.name: {} for s in setups}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def timed(setup: Setup, prompt: list[int]) -> Times | None:
            try:
                return await asyncio.wait_for(one_request(http, setup, prompt),
                                              request_timeout)
            except asyncio.TimeoutError:
                return None

        for setup in setups:  # warm up
            await timed(setup, [rng.randrange(3, 2000) for _ in range(64)])
        for size in sizes:
            for conc in concurrency:
                key = (size, conc)
                for rnd in range(repeats):
                    prompts = [[rng.randrange(3, 2000) for _ in range(size)]
                               for _ in range(conc)]
                    turn = rnd % len(setups)
                    for setup in setups[turn:] + setups[:turn]:
                        await asyncio.sleep(SETTLE_S)  # the last setup's workers go idle
                        times = await asyncio.gather(*(timed(setup, p) for p in prompts))
                        ok = [t for t in times if t is not None]
                        stuck[setup.name][key] = (stuck[setup.name].get(key, 0)
                                                  + len(times) - len(ok))
                        if ok:
                            samples[setup.name].setdefault(key, []).append(
                                (statistics.mean(t[0] for t in ok),
                                 statistics.mean(t[1] for t in ok)))
                console.log(f"{size} tokens x{conc}: " + ", ".join(
                    f"{s.name} {_median(samples[s.name][key])[0] * 1e3:.1f} ms"
                    if samples[s.name].get(key) else f"{s.name} -" for s in setups))
    results = {name: {key: _median(v) for key, v in per.items()}
               for name, per in samples.items()}
    return results, stuck


def _median(times: list[Times]) -> Times:
    return (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="128,512,2000")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-builtin", action="store_true")
    parser.add_argument("--skip-appliance", action="store_true",
                        help="no run through our proxy (P's token first)")
    parser.add_argument("--compare-late", action="store_true",
                        help="also run ours with early_push=false (the reference's timing)")
    parser.add_argument("--compare-immediate", action="store_true",
                        help="also run ours with cpu_push_delay_ms=0 (push right after the "
                        "forward even on CPU)")
    parser.add_argument("--compare-ref", metavar="GIT_REF",
                        help="also run ours as of this commit (a worktree of it, in the same "
                        "run): the before/after of a change")
    parser.add_argument("--request-timeout", type=float, default=60.0,
                        help="seconds after which a request without a first token is stuck")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pd-bench-ttft"))
    parser.add_argument("--model", choices=["kvbench", "mla"], default="kvbench",
                        help="the tiny model: kvbench (GQA, 48 KiB of KV per token) or mla "
                        "(DeepSeek-style latent, float32, blocks of 16)")
    args = parser.parse_args()
    # A kill (timeout, Ctrl-C from a wrapper) still stops every server: they run in their
    # own sessions and would outlive us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(x) for x in args.sizes.split(",")]
    conc = [int(x) for x in args.concurrency.split(",")]
    model = tinymodel.build(ROOT / ".cache" / "models" / args.model, args.model)
    args.log_dir.mkdir(parents=True, exist_ok=True)

    makers = [plain_setup, ours_setup]
    if args.compare_late:
        makers.append(lambda model, log_dir: ours_setup(model, log_dir, early_push=False))
    if args.compare_immediate:
        makers.append(lambda model, log_dir: ours_setup(model, log_dir, cpu_push_delay_ms=0))
    if args.compare_ref:
        code = checkout(args.compare_ref, args.log_dir / "ref-checkout")
        makers.append(lambda model, log_dir: ours_setup(
            model, log_dir, name=f"ours@{args.compare_ref[:10]}", code=code))
    if not args.skip_builtin:
        makers.append(builtin_setup)
    if not args.skip_appliance:
        makers.insert(2, appliance_setup)
    setups = [make(model, args.log_dir) for make in makers]
    started: list[Setup] = []
    try:
        for setup in setups:  # all up at once: they take turns (see measure)
            console.log(f"starting {setup.name}")
            setup.start()
            started.append(setup)
            asyncio.run(discover_engine(setup))
        results, stuck = asyncio.run(
            measure(setups, sizes, conc, args.repeats, 1, args.request_timeout))
    finally:
        for setup in reversed(started):
            setup.stop()

    kv_per_token = tinymodel.SIZES[args.model].kv_bytes_per_token()
    names = [s.name for s in setups if s.name != "plain"]
    for which, title in ((0, "Time to first token"), (1, "Time to second token")):
        table = Table(title=f"{title} (median ms); added = setup - plain, same run")
        for col in ("prompt tokens", "conc", "KV MiB", "plain",
                    *(f"{n} added" for n in names),
                    *(f"{n}/built-in" for n in ("ours", "appliance") if n in names
                      and "builtin" in names)):
            table.add_column(col, justify="right")
        for size in sizes:
            for c in conc:
                plain = results["plain"].get((size, c), (float("nan"),) * 2)[which]
                added = {n: results[n].get((size, c), (float("nan"),) * 2)[which] - plain
                         for n in names}
                row = [str(size), str(c), f"{size * kv_per_token / 2**20:.1f}",
                       f"{plain * 1e3:.1f}", *(f"{added[n] * 1e3:.1f}" for n in names)]
                for n in ("ours", "appliance"):
                    if n in names and "builtin" in names:
                        b = added["builtin"]
                        row.append(f"{added[n] / b:.2f}" if b > 0 else "-")
                table.add_row(*row)
        Console(width=160).print(table)
    for name, counts in stuck.items():
        for (size, c), n in counts.items():
            if n:
                print(f"{name}: {n} request(s) of {size} tokens x{c} got no first token "
                      f"within {args.request_timeout:g} s")


if __name__ == "__main__":
    main()
