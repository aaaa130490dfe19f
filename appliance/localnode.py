"""A 1P1D node as local processes: bootstrap sidecar, vLLM P and D with PDConnector, and
(when `proxy_port` is set) the proxy in front of them.

Used by the end-to-end tests, the benchmarks and `pdctl up --local`. On a machine without
a GPU it runs the CPU build of vLLM with Mooncake over TCP, each vLLM server pinned to its
own CPUs.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import keys, kvbudget
from appliance.keys import API_KEY_FILE_ENV, NodeKeys
from appliance.observability.tracing import DEFAULT_PROTOCOL, ENDPOINT_ENV, PROTOCOL_ENV
from appliance.process import (
    CPU_BLOCK_SIZE,
    CPU_EAGER,
    DECODE_PREFILL_CHUNK,
    ENGINE_STEP_TOKENS,
    KV_EVENTS_FLAGS,
    ServiceFailed,
    ServiceProcess,
    cpu_env,
    decode_chunk_flags,
    kv_cache_flags,
    step_tokens_flags,
    vllm_serve_argv,
)
from appliance.proxy.prefix.tokenizer import folder_of


@dataclass
class NodeSpec:
    model: Path
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    prefill_port: int = 8010
    decode_port: int = 8020
    bootstrap_port: int = 8998
    prefill_engine_id: str = "prefill-0"
    decode_engine_id: str = "decode-0"
    prefill_cpus: tuple[int, ...] | None = (0,)
    decode_cpus: tuple[int, ...] | None = (1,)
    max_model_len: int = 2048
    # Bytes of KV cache per server; None: sized from the model (appliance.kvbudget).
    kv_cache_bytes: int | None = None
    bootstrap_ttl: float = 30.0
    connector_extra: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    log_dir: Path = Path("/tmp/pd-node")
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per role, applied after extra_env (e.g. one OpenMP core list per dp rank of P).
    prefill_env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)
    # The proxy as a fourth service (None: no proxy); it listens on proxy_host.
    proxy_port: int | None = None
    proxy_host: str | None = None
    proxy_args: tuple[str, ...] = ("--health-interval", "0.5")
    # Traces (appliance.observability.tracing): P, D (vLLM's spans and the connector's) and
    # the proxy export to this OTLP endpoint; None: off.
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = DEFAULT_PROTOCOL
    # D's longest prefill chunk while other requests run (tokens; 0: no cap;
    # appliance.process.decode_chunk_flags): the CPU stack's default.
    decode_prefill_chunk: int = DECODE_PREFILL_CHUNK["cpu"]
    # Each engine's token budget per step (0: vLLM's own; appliance.process.
    # ENGINE_STEP_TOKENS): the CPU stack's default.
    max_num_batched_tokens: int = ENGINE_STEP_TOKENS["cpu"]
    # Extra vLLM flags per role (appended, so they override the defaults above).
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    # Keys on every internal endpoint (`pdctl up --local` always): P and D need vLLM's
    # --api-key, the sidecar its token (for /query too), the side channels CURVE, and D
    # pulls only through this node's sidecar. Off: the reference's open trust model, which
    # tests that talk to P and D directly use.
    secure: bool = False
    keys_dir: Path | None = None  # default: log_dir / "keys"

    @property
    def keys(self) -> NodeKeys:
        return NodeKeys(self.keys_dir or self.log_dir / "keys")

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.host}:{self.bootstrap_port}"

    @property
    def prefill_url(self) -> str:
        return f"http://{self.host}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.host}:{self.decode_port}"

    @property
    def proxy_url(self) -> str | None:
        if self.proxy_port is None:
            return None
        host = self.proxy_host or self.host
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.proxy_port}"

    def kv_transfer_config(self, role: str) -> str:
        engine = self.prefill_engine_id if role == "kv_producer" else self.decode_engine_id
        extra: dict[str, Any] = {"bootstrap_addr": self.bootstrap_url, "protocol": "tcp",
                                 "host": self.host}
        if self.secure:
            extra |= {"bootstrap_token_file": str(self.keys.bootstrap_token),
                      "side_channel_key_file": str(self.keys.side_channel_key)}
            if role == "kv_consumer":
                extra["allowed_bootstrap_addrs"] = [self.bootstrap_url]
        extra |= self.connector_extra
        return json.dumps({"kv_connector": "PDConnector",
                           "kv_connector_module_path": "appliance.connector.facade",
                           "kv_role": role, "engine_id": engine,
                           "kv_load_failure_policy": self.kv_load_failure_policy,
                           "kv_connector_extra_config": extra})


GUARD = "appliance.connector.httpguard.KVParamsGuard"


def _omp_bind(cpus: tuple[int, ...] | None) -> str:
    return ",".join(map(str, cpus)) if cpus else "auto"


class LocalNode:
    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        s = spec
        if s.secure:
            keys.ensure(s.keys.dir)
        token = (["--token-file", str(s.keys.bootstrap_token)] if s.secure else ["--no-token"])
        self.bootstrap = ServiceProcess(
            "bootstrap",
            [sys.executable, "-m", "appliance.bootstrap", "--host", s.host, "--port",
             str(s.bootstrap_port), "--ttl", str(s.bootstrap_ttl), *token],
            s.log_dir / "bootstrap.log", health_url=f"{s.bootstrap_url}/health")
        self.kv_bytes = kvbudget.budget(s.kv_cache_bytes, s.model, s.max_model_len,
                                        CPU_BLOCK_SIZE)
        self.prefill = self._vllm("prefill", s.prefill_port, "kv_producer", s.prefill_cpus)
        self.decode = self._vllm("decode", s.decode_port, "kv_consumer", s.decode_cpus)
        self.proxy: ServiceProcess | None = None
        if s.proxy_port is not None:
            self.proxy = ServiceProcess(
                "proxy",
                [sys.executable, "-m", "appliance.proxy", "--host", s.proxy_host or s.host,
                 "--port", str(s.proxy_port), "--prefill", f"{s.prefill_url},{s.bootstrap_url}",
                 "--decode", s.decode_url, *self._proxy_keys(), *self._tracing_args(),
                 *self._tokenizer_args(), "--kv-block-size", str(CPU_BLOCK_SIZE),
                 # auto weighs a local prefill by the chunk D computes it in
                 *(("--decode-prefill-chunk", str(s.decode_prefill_chunk))
                   if s.decode_prefill_chunk else ()),
                 # within ServiceProcess.stop's 20 s before SIGKILL
                 "--drain-grace", "10", *s.proxy_args],
                s.log_dir / "proxy.log", health_url=f"{s.proxy_url}/health")
        self.timings: dict[str, float] = {}

    def _tracing_args(self) -> list[str]:
        s = self.spec
        return (["--otlp-traces-endpoint", s.otlp_traces_endpoint, "--otlp-traces-protocol",
                 s.otlp_traces_protocol] if s.otlp_traces_endpoint else [])

    def _tokenizer_args(self) -> list[str]:
        """The model's tokenizer for the proxy, which runs beside the engines here: it
        tokenizes prompts for its prefix index without a round trip to D."""
        folder = folder_of(str(self.spec.model))
        return ["--tokenizer", folder] if folder else []

    def _proxy_keys(self) -> list[str]:
        k = self.spec.keys
        return (["--backend-api-key-file", str(k.api_key), "--bootstrap-token-file",
                 str(k.bootstrap_token), "--side-channel-key-file", str(k.side_channel_key)]
                if self.spec.secure else [])

    def _vllm(self, name: str, port: int, role: str,
              cpus: tuple[int, ...] | None) -> ServiceProcess:
        s = self.spec
        guard = (("--middleware", GUARD) if s.secure and role == "kv_consumer" else ())
        argv = vllm_serve_argv(s.model, port, host=s.host, served_model_name=s.served_model_name,
                               block_size=CPU_BLOCK_SIZE, max_model_len=s.max_model_len,
                               kv_transfer_config=s.kv_transfer_config(role),
                               extra=(*CPU_EAGER, *kv_cache_flags(self.kv_bytes), *guard,
                                      *KV_EVENTS_FLAGS, *self._tracing_args()[:2],
                                      *step_tokens_flags(s.max_num_batched_tokens),
                                      *(s.prefill_args if role == "kv_producer"
                                        else (*decode_chunk_flags(s.decode_prefill_chunk),
                                              *s.decode_args))))
        role_env = s.prefill_env if role == "kv_producer" else s.decode_env
        own_env = {API_KEY_FILE_ENV: str(s.keys.api_key)} if s.secure else {}
        if s.otlp_traces_endpoint:  # vLLM's own exporter and the connector's read these
            own_env |= {ENDPOINT_ENV: s.otlp_traces_endpoint,
                        PROTOCOL_ENV: s.otlp_traces_protocol}
        return ServiceProcess(name, argv, s.log_dir / f"{name}.log",
                              env={**cpu_env(_omp_bind(cpus), s.host), **own_env,
                                   **s.extra_env, **role_env},
                              health_url=f"http://{s.host}:{port}/health", cpus=cpus)

    @property
    def services(self) -> list[ServiceProcess]:
        core = [self.bootstrap, self.prefill, self.decode]
        return core + [self.proxy] if self.proxy is not None else core

    def start(self, timeout: float = 300.0,
              progress: Callable[[str, float], None] | None = None) -> dict[str, float]:
        """Start every service and wait until healthy; returns seconds to healthy each."""
        self.start_processes()
        return self.wait_healthy(timeout, progress)

    def start_processes(self) -> None:
        self._begin = time.monotonic()
        try:
            for svc in self.services:
                svc.start()
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout: float = 300.0,
                     progress: Callable[[str, float], None] | None = None) -> dict[str, float]:
        """Poll every service at once until all are healthy and P is registered.

        `timings` gets each service's seconds from start to healthy (and "registered": P's
        engine id in the bootstrap); `progress(name, seconds)` is called as each arrives.
        On failure or timeout every service is stopped.
        """
        begin = getattr(self, "_begin", time.monotonic())
        pending = list(self.services)
        registered = False
        try:
            while pending or not registered:
                for svc in list(pending):
                    if svc.poll_healthy():
                        pending.remove(svc)
                        self._arrived(svc.name, begin, progress)
                if not registered and self.bootstrap not in pending and self._registered():
                    registered = True
                    self._arrived("registered", begin, progress)
                if not pending and registered:
                    break
                if time.monotonic() - begin > timeout:
                    late = pending[0] if pending else self.prefill
                    what = late.name if pending else "the prefill engine's registration"
                    raise ServiceFailed(f"{what} not ready after {timeout:.0f}s; last log "
                                        f"lines of {late.name}:\n{late.log_tail()}")
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        return self.timings

    def _arrived(self, name: str, begin: float,
                 progress: Callable[[str, float], None] | None) -> None:
        self.timings[name] = time.monotonic() - begin
        if progress is not None:
            progress(name, self.timings[name])

    def _registered(self) -> bool:
        req = urllib.request.Request(f"{self.spec.bootstrap_url}/query",
                                     headers=self.auth_headers("bootstrap"))
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                engine = self.spec.prefill_engine_id
                # With --data-parallel-size vLLM names each rank's engine "<id>_dp<rank>".
                return any(v.get("engine_id") == engine
                           or str(v.get("engine_id", "")).startswith(f"{engine}_dp")
                           for v in json.load(r).values())
        except (OSError, ValueError, AttributeError):
            return False

    def auth_headers(self, service: str) -> dict[str, str]:
        """What a caller inside the node sends to "prefill", "decode" or "bootstrap"."""
        if not self.spec.secure:
            return {}
        k = self.spec.keys
        secret = keys.read(k.bootstrap_token if service == "bootstrap" else k.api_key)
        return {"Authorization": f"Bearer {secret}"}

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop()

    def __enter__(self) -> LocalNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
