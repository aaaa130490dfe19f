"""`pdctl up --local` / `down --local`: the 1P1D node as local processes, no containers.

bootstrap + vLLM P + vLLM D (CPU build without a GPU, Mooncake over TCP) + the proxy. A
state file in the run directory records every service's process group and a run id that
each process (and every child vLLM spawns) carries in its environment, so `pdctl down
--local` from another shell stops exactly these processes and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from appliance import kvbudget, tinymodel
from appliance.launcher import installed_vllm
from appliance.localnode import LocalNode, NodeSpec
from appliance.pdctl.config.sections import TransferSection
from appliance.pdctl.errors import USAGE, PdctlError
from appliance.pdctl.host.probe import split_cpus
from appliance.pdctl.node.localstate import (
    RUN_ID_ENV,
    STATE_FILE,
    LocalState,
    ServiceRecord,
    alive,
    kill_marked,
    marked_processes,
)
from appliance.pdctl.node.status import Endpoints
from appliance.process import ServiceFailed

TINY = "tiny"


def default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pd-appliance"


def default_run_dir() -> Path:
    return Path(os.environ.get("PDCTL_RUN_DIR") or default_home() / "run")


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDCTL_CACHE_DIR") or default_home())


@dataclass(frozen=True)
class LocalOptions:
    host: str = "127.0.0.1"
    proxy_port: int = 8000
    prefill_port: int = 8010
    decode_port: int = 8020
    bootstrap_port: int = 8998
    model: Path | None = None  # None: the tiny model, built on first use
    served_model_name: str | None = None
    max_model_len: int = 2048
    kv_cache_bytes: int | None = None  # None: sized from the model and max_model_len
    run_dir: Path = Path(".")
    cache_dir: Path = Path(".")
    timeout: float = 600.0

    def ports(self) -> dict[str, int]:
        return {"proxy": self.proxy_port, "prefill": self.prefill_port,
                "decode": self.decode_port, "bootstrap": self.bootstrap_port}

    def problems(self) -> list[str]:
        seen: dict[int, str] = {}
        out = []
        for name, port in self.ports().items():
            if not 1 <= port <= 65535:
                out.append(f"--{name}-port: {port} is not a port")
            elif port in seen:
                out.append(f"the {name} port {port} is also the {seen[port]} port")
            seen.setdefault(port, name)
        return out


def _port_free(host: str, port: int) -> bool:
    """Nothing listens there. SO_REUSEADDR as the servers set it: connections of a node
    stopped a moment ago, lingering in TIME_WAIT, do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ---- up ---------------------------------------------------------------------------------

class _Stop(Exception):
    """SIGTERM/SIGHUP: stop like Ctrl-C."""


def mooncake_port_env() -> dict[str, str]:
    """Mooncake listens on every address; keep its ports in the range a host config would
    (transfer.port_range) so one firewall rule covers them here too."""
    first, last = TransferSection().port_range
    return {"MC_MIN_RPC_PORT": str(first), "MC_MAX_RPC_PORT": str(last)}


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def resolve_model(opts: LocalOptions, say: Callable[[str], None]) -> tuple[Path, str, float | None]:
    """(model dir, served name, seconds spent building it or None when reused)."""
    if opts.model is not None:
        if not (opts.model / "config.json").is_file():
            raise PdctlError(f"--model {opts.model}: not a model directory (no config.json)",
                             USAGE)
        return opts.model, opts.served_model_name or opts.model.name, None

    target = opts.cache_dir / "models" / TINY
    fresh = not (target / tinymodel.STAMP).exists()
    if fresh:
        say(f"building the tiny model into {target} (first use, a few seconds)")
    begin = time.monotonic()
    try:
        tinymodel.build(target, TINY)
    except ImportError as exc:
        raise PdctlError(f"cannot build the tiny model: {exc} (run ./install.sh --cpu)") from None
    except OSError as exc:
        raise PdctlError(f"cannot build the tiny model in {target}: {exc}") from None
    return target, opts.served_model_name or TINY, \
        (time.monotonic() - begin) if fresh else None


def up_local(opts: LocalOptions, console: Console, detach: bool = False) -> int:
    begin = time.monotonic()
    problems = opts.problems()
    if problems:
        raise PdctlError(problems, USAGE)
    run_dir = opts.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = LocalState.load(run_dir)
    if previous is not None:
        if marked_processes(previous.run_id):
            raise PdctlError(f"a local node is already running (state in {run_dir}; proxy "
                             f"{previous.endpoints.get('proxy')}); stop it with "
                             f"`pdctl down --local`")
        (run_dir / STATE_FILE).unlink(missing_ok=True)
    if installed_vllm() is None:
        raise PdctlError("vLLM is not installed in this Python environment (run "
                         "./install.sh --cpu, then use .venv/bin/pdctl)")
    busy = [f"port {port} ({name}) on {opts.host} is in use"
            for name, port in opts.ports().items() if not _port_free(opts.host, port)]
    if busy:
        raise PdctlError(busy + ["pick others with --port/--prefill-port/--decode-port/"
                                 "--bootstrap-port, or stop what listens there"])

    say = lambda text: console.print(f"pdctl: {text}")  # noqa: E731
    model, served, built = resolve_model(opts, say)
    p_cpus, d_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
    log_dir = run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    for old in log_dir.glob("*.log"):
        old.unlink()
    spec = NodeSpec(model=model, served_model_name=served, host=opts.host,
                    prefill_port=opts.prefill_port, decode_port=opts.decode_port,
                    bootstrap_port=opts.bootstrap_port, proxy_port=opts.proxy_port,
                    prefill_cpus=p_cpus, decode_cpus=d_cpus, max_model_len=opts.max_model_len,
                    kv_cache_bytes=opts.kv_cache_bytes, log_dir=log_dir,
                    secure=True, keys_dir=run_dir / "keys", extra_env=mooncake_port_env())
    try:
        node = LocalNode(spec)
    except kvbudget.ModelShapeError as exc:
        raise PdctlError(f"cannot size the KV cache: {exc} (pass --kv-cache-bytes)",
                         USAGE) from None
    how = "--kv-cache-bytes" if opts.kv_cache_bytes else \
        f"{kvbudget.SEQUENCES} requests of {opts.max_model_len} tokens"
    say(f"KV cache {node.kv_bytes >> 20} MiB per server ({how})")
    run_id = uuid.uuid4().hex
    for svc in node.services:
        svc.env = {**svc.env, RUN_ID_ENV: run_id}
    endpoints = Endpoints(bootstrap=spec.bootstrap_url, prefill=spec.prefill_url,
                          decode=spec.decode_url, proxy=spec.proxy_url or "",
                          prefill_engine_id=spec.prefill_engine_id)

    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    state: LocalState | None = None
    keep = False  # detached and healthy: leave the services running
    try:
        say(f"starting bootstrap, prefill, decode and proxy (model {model}, logs in {log_dir})")
        node.start_processes()
        state = LocalState(run_id=run_id, supervisor_pid=None if detach else os.getpid(),
                           started_at=time.time(), model=str(model),
                           endpoints=asdict(endpoints),
                           services=[ServiceRecord(s.name, s.proc.pid, s.health_url or "",
                                                   str(s.log_path)) for s in node.services])
        state.save(run_dir)
        start = time.monotonic()
        remaining = max(1.0, opts.timeout - (start - begin))
        with console.status("waiting for the services to be healthy") as spinner:
            def progress(name: str, seconds: float) -> None:
                what = "prefill engine registered with the bootstrap" \
                    if name == "registered" else f"{name} healthy"
                console.print(f"  {what} after {seconds:.1f} s")
                spinner.update(f"waiting ({', '.join(sorted(node.timings))} ready)")

            node.wait_healthy(remaining, progress)
        total = time.monotonic() - begin
        _print_ready(console, node.timings, total, start - begin, built, endpoints, served,
                     run_dir)
        if detach:
            keep = True
            console.print("pdctl: running in the background; stop it with "
                          "`pdctl down --local`")
            return 0
        console.print("pdctl: Ctrl-C (or `pdctl down --local` in another shell) stops it")
        return _supervise(node, console)
    except ServiceFailed as exc:
        first, _, rest = str(exc).partition("\n")
        raise PdctlError(first, detail=rest) from None
    except KeyboardInterrupt:
        console.print("pdctl: interrupted; stopping the local node")
        return 130
    except _Stop:
        console.print("pdctl: asked to stop; stopping the local node")
        return 0
    finally:
        if not keep:
            # A second Ctrl-C or SIGTERM must not cut the clean-up short.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                handlers.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, signal.SIG_IGN)
            node.stop()
            if state is not None:
                kill_marked(run_id, {s.pid for s in state.services}, grace=5.0)
            (run_dir / STATE_FILE).unlink(missing_ok=True)
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _supervise(node: Any, console: Console) -> int:
    while True:
        for svc in node.services:
            if not svc.running:
                raise PdctlError(f"{svc.name} exited with code {svc.proc.returncode}; "
                                 f"stopping the node", detail=svc.log_tail())
        time.sleep(1.0)


def _print_ready(console: Console, timings: dict[str, float], total: float, setup: float,
                 built: float | None, endpoints: Endpoints, served: str, run_dir: Path) -> None:
    table = Table(title=f"node healthy in {total:.1f} s: setup {setup:.1f} s, then the "
                  f"services (started together) in {max(timings.values()):.1f} s",
                  title_justify="left")
    table.add_column("step")
    table.add_column("ready after (s)", justify="right")
    table.add_column("what")
    table.add_row("setup", f"{setup:.1f}", "checks and the model" + (
        f" (tiny model built in {built:.1f} s)" if built else " (cached)"))
    notes = {"bootstrap": "sidecar /health", "prefill": "vLLM P /health",
             "decode": "vLLM D /health", "registered": "P's engine id in the bootstrap",
             "proxy": "proxy /health (P registered, D up)"}
    for name, seconds in sorted(timings.items(), key=lambda kv: kv[1]):
        table.add_row(name, f"{seconds:.1f}", notes.get(name, ""))
    console.print(table)
    console.print(f"proxy: {endpoints.proxy}  (prefill {endpoints.prefill}, decode "
                  f"{endpoints.decode}, bootstrap {endpoints.bootstrap}; state in {run_dir})")
    console.print(f"try: curl -s {endpoints.proxy}/v1/completions -H 'Content-Type: "
                  f"application/json' -d '{{\"model\": \"{served}\", \"prompt\": \"The quick "
                  f"brown fox\", \"max_tokens\": 16, \"temperature\": 0}}'", soft_wrap=True)


# ---- down -------------------------------------------------------------------------------

def down_local(run_dir: Path, console: Console, timeout: float = 90.0) -> int:
    state = LocalState.load(run_dir)
    if state is None:
        console.print(f"pdctl: no local node is running (no state in {run_dir})")
        return 0
    names = ", ".join(s.name for s in state.services)
    sup = state.supervisor_pid
    if sup is not None and sup != os.getpid() and alive(sup) and \
            marked_processes(state.run_id):
        # The foreground `pdctl up --local` stops its own services, as on Ctrl-C.
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while alive(sup) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = kill_marked(state.run_id, {s.pid for s in state.services}, grace=20.0)
    if left:
        raise PdctlError(f"processes of the node survived SIGKILL: "
                         f"{', '.join(map(str, sorted(left)))}")
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    console.print(f"pdctl: stopped {names}")
    return 0


# ---- logs -------------------------------------------------------------------------------

def follow_file(path: Path, tail: int, follow: bool, write: Callable[[str], None]) -> None:
    lines = path.read_text(errors="replace").splitlines()
    for line in lines[-tail:] if tail else lines:
        write(line)
    if not follow:
        return
    with path.open(errors="replace") as f:
        f.seek(0, os.SEEK_END)
        while True:
            line = f.readline()
            if line:
                write(line.rstrip("\n"))
            else:
                time.sleep(0.5)
