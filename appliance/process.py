"""Local service processes: vLLM servers, the bootstrap sidecar, the proxy.

Used by the tests and by `pdctl up --local`. Each service runs in its own process group
(so stopping it stops vLLM's engine and worker processes too), optionally pinned to a set
of CPUs: with P and D on one small CPU machine, D's idle busy-wait would otherwise slow
P's prefill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance import kvbudget


class ServiceFailed(RuntimeError):
    """A service exited or did not become healthy in time."""


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    health_url: str | None = None
    cpus: Sequence[int] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        cpus = set(self.cpus) if self.cpus else None

        def _pin() -> None:  # runs in the child before exec; inherited by its children
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True, preexec_fn=_pin,
            cwd=self.cwd,
        )
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def poll_healthy(self) -> bool:
        """One health probe; raises ServiceFailed when the process has exited."""
        if not self.running:
            code = self.proc.returncode if self.proc else None
            raise ServiceFailed(f"{self.name} exited with code {code}; last log lines:\n"
                                f"{self.log_tail()}")
        return self.health_url is None or http_ok(self.health_url)

    def wait_healthy(self, timeout: float, poll: float = 0.5) -> float:
        """Poll health_url until it answers 200; returns seconds waited."""
        start = time.monotonic()
        while True:
            if self.poll_healthy():
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ServiceFailed(f"{self.name} not healthy after {timeout:.0f}s "
                                    f"({self.health_url}); last log lines:\n{self.log_tail()}")
            time.sleep(poll)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after the timeout."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; make sure no straggler of its group survives.
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def vllm_serve_argv(model: str | Path, port: int, *, host: str = "127.0.0.1",
                    served_model_name: str | None = None, block_size: int | None = None,
                    max_model_len: int | None = None, kv_transfer_config: str | None = None,
                    extra: Sequence[str] = ()) -> list[str]:
    """The command line of one vLLM OpenAI server through the launcher."""
    argv = [sys.executable, "-m", "appliance.launcher", "serve", str(model),
            "--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if block_size:
        argv += ["--block-size", str(block_size)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if kv_transfer_config:
        argv += ["--kv-transfer-config", kv_transfer_config]
    return argv + list(extra)


# Flags and environment that the CPU build needs on a small machine (see README):
# eager mode starts faster, the CPU attention backend wants blocks of 32, and a KV budget
# in bytes keeps two servers within memory (appliance.kvbudget sizes it from the model;
# CPU_SERVE_FLAGS carries the smallest budget, which fits the tiny model).
CPU_EAGER = ("--enforce-eager",)
CPU_BLOCK_SIZE = 32


# D's default prefill chunk per stack: on this CPU build the kvbench model computes 128
# tokens in about 90 ms, within the ITL budget of 3 decode steps (README); on a GPU a
# 512-token chunk of a common model takes a few ms to tens of ms (not measured here).
DECODE_PREFILL_CHUNK = {"gpu": 512, "cpu": 128}


def decode_chunk_flags(tokens: int) -> tuple[str, ...]:
    """D's longest prefill chunk while other requests run (vLLM's long-prefill token
    threshold): a prompt D computes itself (split=auto's local) then stalls D's decodes a
    chunk per step, not its whole prefill. 0: no cap (vLLM's default)."""
    return ("--long-prefill-token-threshold", str(tokens)) if tokens else ()


# Each engine's token budget per step (vLLM's --max-num-batched-tokens; 0: vLLM's own, 2,048
# on CPU). Prompts that arrive together are then computed a budget at a time, first come
# first, instead of all in one long step: the first answers start while the rest compute
# (a conversation's turns through the node: TTFT p50 0.46 of a plain server's, 1.07
# with vLLM's budget; bench/serve.py), and a decode waits at most one budget's step. On
# this CPU build a step's fixed cost is small against 256 tokens' compute (the rate did
# not move); the GPU keeps vLLM's default, which is sized for its devices.
ENGINE_STEP_TOKENS = {"gpu": 0, "cpu": 256}


def step_tokens_flags(tokens: int) -> tuple[str, ...]:
    """An engine's token budget per step (vLLM's own default for 0)."""
    return ("--max-num-batched-tokens", str(tokens)) if tokens else ()


def kv_cache_flags(nbytes: int) -> tuple[str, ...]:
    return ("--kv-cache-memory-bytes", str(int(nbytes)))


CPU_SERVE_FLAGS = (*CPU_EAGER, *kv_cache_flags(kvbudget.FLOOR))

# Each P and D publishes its KV-cache events for the proxy's prefix index
# (appliance.proxy.prefix): on its node address (VLLM_HOST_IP) at ports vLLM picks and lists
# at GET /kv_event_sources, never on every interface; hashed with sha256_cbor, which the
# proxy computes the same way from a prompt's token ids.
KV_EVENTS_CONFIG = ('{"enable_kv_cache_events":true,"publisher":"zmq",'
                    '"endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}')
KV_EVENTS_FLAGS = ("--prefix-caching-hash-algo", "sha256_cbor",
                   "--kv-events-config", KV_EVENTS_CONFIG)


def cpu_env(omp_bind: str, host_ip: str = "127.0.0.1") -> dict[str, str]:
    return {
        "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
        "VLLM_HOST_IP": host_ip,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING"),
    }
