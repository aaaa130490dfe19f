"""Typed settings of the proxy: a TOML file, the environment and CLI flags, the flags
winning. Each setting is one field: its description is its --help, its Flag its group and
spelling (appliance.modelflags builds the parser from them)."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from appliance import keys, modelflags
from appliance.deadlines import (
    DEFAULT_PREFILL_S,
    DEFAULT_TRANSFER_S,
    WRITE_MARGIN_MAX_S,
    Deadlines,
)
from appliance.modelflags import Flag
from appliance.proxy.k8s_settings import KubernetesSettings
from appliance.proxy.nodesettings import (
    DecodeNode,
    PrefillNode,
    parse_decode_flag,
    parse_prefill_flag,
)

__all__ = ["API_KEYS_ENV", "DecodeNode", "KubernetesSettings", "PrefillNode", "ProxySettings",
           "RoutingPolicy", "Split", "build_parser", "load_settings", "load_toml"]

# Adaptive disaggregation's policy (appliance.proxy.placement).
Split = Literal["always", "never", "auto"]
# Which P and D serve a request (appliance.proxy.placement.routing).
RoutingPolicy = Literal["round_robin", "least_outstanding", "cache_aware", "cache_aware_sglang"]

DEFAULT_PORT = 8000
API_KEYS_ENV = "APPLIANCE_PROXY_API_KEYS"

# The --help sections, in the order the fields first name them.
LISTENER = "listener"
NODES = "nodes"
TIMEOUTS = "timeouts"
ADMISSION = "admission"
PLACEMENT = "placement"
PREFIX = "prefix index"
TRACING = "tracing"
SECURITY = "security"
TLS = "TLS"
LOGGING = "logging"


class ProxySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: Annotated[str, Flag(LISTENER)] = Field(
        "0.0.0.0", description="the address the proxy listens on")
    port: Annotated[int, Flag(LISTENER)] = Field(
        DEFAULT_PORT, ge=0, le=65535, description="the port the proxy listens on")
    max_body_bytes: Annotated[int, Flag(LISTENER, metavar="BYTES")] = Field(
        4 * 1024 * 1024, ge=1024, description="the largest request body accepted")

    discovery: Annotated[Literal["static", "kubernetes"], Flag(NODES)] = Field(
        "static", description="where P and D come from: --prefill/--decode (static) or the "
                              "Ready pods the --k8s-*-selector flags match")
    kubernetes: Annotated[KubernetesSettings, Flag(NODES, name="k8s")] = Field(
        default_factory=KubernetesSettings,
        description="--discovery kubernetes: the pods found by label (the lists left empty)")
    prefill: Annotated[list[PrefillNode], Flag(NODES, metavar="URL[,BOOTSTRAP_URL]",
                                               parse=parse_prefill_flag)] = Field(
        default_factory=list,
        description="a prefill node; its bootstrap defaults to the host's :8998")
    decode: Annotated[list[DecodeNode], Flag(NODES, metavar="URL",
                                             parse=parse_decode_flag)] = Field(
        default_factory=list, description="a decode node")
    health_interval_s: Annotated[float, Flag(NODES)] = Field(
        2.0, gt=0, description="how often each node's health is checked")
    health_timeout_s: Annotated[float, Flag(NODES)] = Field(
        2.0, gt=0, description="the longest a health check waits for its answer")
    # A frozen node answers nothing, ever: its calls fail at once rather than at their
    # timeouts (P's then go to D alone, as when P is unreachable; D's end with an error).
    down_after_failures: Annotated[int, Flag(NODES, metavar="N")] = Field(
        2, ge=1, description="failed health checks in a row after which a node counts as "
                             "down and the calls it holds fail")
    # Beyond, a call waits up to connect_timeout_s for one to free up.
    max_connections_per_node: Annotated[int, Flag(NODES, metavar="N")] = Field(
        1024, ge=1, description="connections open at once to one node")

    connect_timeout_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        5.0, gt=0, description="the longest wait to connect to P or D")
    # P says nothing until its one token is out. Past it P's and D's calls are closed (P
    # never computes a prompt still queued). D's receive deadline and P's hold derive from
    # it and from kv_transfer_s (appliance.deadlines).
    prefill_timeout_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        DEFAULT_PREFILL_S, gt=0, description="the longest wait for P's answer (its queue and "
                                             "prefill); past it D alone answers")
    kv_transfer_s: Annotated[float, Flag(TIMEOUTS, name="kv-transfer-timeout")] = Field(
        DEFAULT_TRANSFER_S, ge=WRITE_MARGIN_MAX_S,
        description="D's wait for the KV beyond --prefill-timeout")
    # D waits for the KV before it speaks; a non-streaming answer is one long silence.
    decode_read_timeout_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        300.0, gt=0, description="the longest silence from D, counted from P's answer")
    # The timeouts above bound silences; past this the call is cut and the client gets an
    # error.
    upstream_deadline_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        1800.0, gt=0, description="the longest any one call to P or D may take, a whole "
                                  "stream included")
    # From the request's head to its body's last byte: max_body_bytes (4 MiB) arrives in it
    # at 1.1 Mbit/s. Past it a 408, and the connection is closed (appliance.proxy.intake).
    body_timeout_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        30.0, gt=0, description="the longest a client may take to send its request body")
    # A rollout's handover, a node back from a failed check.
    node_wait_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        5.0, ge=0, description="how long a request waits for a node in rotation (a decode "
                               "node; a P too, without fallback) before its 503")
    drain_grace_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        30.0, ge=0, description="on SIGTERM, how long requests in flight get to finish; then "
                                "they end with an error")
    drain_handover_s: Annotated[float, Flag(TIMEOUTS)] = Field(
        120.0, ge=0, description="a node drained or leaving (a terminating pod) still "
                                 "answering after this long hands its answers over: each goes "
                                 "on from another engine as after a failure (0: never)")

    # Overload control (appliance.proxy.admission).
    max_in_flight_per_decode: Annotated[int, Flag(ADMISSION, metavar="N")] = Field(
        0, ge=0, description="requests in flight per decode node (0: no limit); beyond, up "
                             "to --max-queued wait, the rest get 429 with Retry-After")
    max_queued: Annotated[int, Flag(ADMISSION, metavar="N")] = Field(
        0, ge=0, description="requests waiting for a decode slot before 429s start")
    queue_timeout_s: Annotated[float, Flag(ADMISSION)] = Field(
        5.0, gt=0, description="the longest a queued request waits for a decode slot")

    # cache_aware without the prefix index is round robin (appliance.proxy.placement.routing).
    policy: Annotated[RoutingPolicy, Flag(PLACEMENT)] = Field(
        "cache_aware", description="which P and D: cache_aware (the prefix index against "
        "load), cache_aware_sglang (SGLang's rule on the same index), round_robin, "
        "least_outstanding")
    # Adaptive disaggregation (appliance.proxy.placement).
    split: Annotated[Split, Flag(PLACEMENT)] = Field(
        "auto", description="always: P prefills every request, D decodes; never: D alone; "
                            "auto: per request, the sooner by the node's measurements")
    itl_slo_ms: Annotated[float | None, Flag(PLACEMENT, metavar="MS")] = Field(
        None, gt=0, description="auto: the most a prefill on D may stall D's running decodes "
                                "(default: 3x D's measured time per token)")
    # vLLM's --long-prefill-token-threshold on D (pdctl and the chart pass theirs): a local
    # prefill stalls each of D's decode steps by one chunk, not by the whole prompt.
    decode_prefill_chunk: Annotated[int | None, Flag(PLACEMENT, metavar="TOKENS")] = Field(
        None, ge=1, description="auto: D's longest prefill chunk while it decodes (tokens; "
                                "default: unknown, a local prefill stalls D's steps whole)")
    # A fresh P is timed by a few one-token completions (appliance.proxy.placement.seeding).
    calibrate: Annotated[bool, Flag(PLACEMENT)] = Field(
        True, description="auto: when P's metrics show no prefill yet, time a few short "
                          "prompts at start, prefilled on P and pulled by D, so the first "
                          "requests are placed by measurement; P's history is read either way")
    # Other proxies in front of the same engines (appliance.proxy.nodes.engineload).
    engine_load_interval_s: Annotated[float, Flag(PLACEMENT)] = Field(
        1.0, ge=0, description="auto: how often each engine's own request gauges are read, "
                               "so work other proxies sent it counts (0: this proxy's alone)")
    # appliance.proxy.exchange.migration: what goes on elsewhere, and what cannot.
    migration_limit: Annotated[int, Flag(PLACEMENT, metavar="N")] = Field(
        1, ge=0, description="how many times one answer may go on from another engine (another "
                             "D, else P) after the one serving it broke off (0: the client "
                             "gets the error)")
    fallback_to_decode: Annotated[bool, Flag(PLACEMENT, name="fallback")] = Field(
        True, description="serve by D alone when P is unreachable or times out, instead of a 503")
    fallback_to_prefill: Annotated[bool, Flag(PLACEMENT)] = Field(
        True, description="with no decode node in rotation (all down, restarting or drained), "
                          "P serves requests whole, instead of a 503")
    # This appliance's connector sends the KV whatever the finish reason, so D is left
    # alone. vLLM's built-in MooncakeConnector only sends KV for length-capped requests, and
    # D would wait for KV that never comes (vllm#46008).
    fallback_on_prefill_stop: Annotated[bool, Flag(PLACEMENT)] = Field(
        False, description="serve by D alone a request P finished with \"stop\" (EOS or a "
                           "stop string): for vLLM's own MooncakeConnector")
    # TTFT becomes P's alone; the second token comes after the transfer and one D step
    # (appliance.proxy.exchange.first_token).
    first_token_from_prefill: Annotated[bool, Flag(PLACEMENT)] = Field(
        True, description="streaming: send P's token to the client at once, D continues "
                          "after it; off: D gives every token")

    # From each P's and D's own KV events (appliance.proxy.prefix). The engines publish them
    # when started with --kv-events-config (pdctl, compose and the chart do); a node that
    # does not is predicted to hold nothing.
    prefix_index: Annotated[bool, Flag(PREFIX)] = Field(
        True, description="auto: follow what each node holds in its prefix cache, to weigh "
                          "only the prompt tokens it would compute")
    prefix_hash_seed: Annotated[str, Flag(PREFIX, metavar="SEED")] = Field(
        "vllm-none-hash", min_length=1,
        description="the seed of the engines' first block hash: vLLM's default, or their "
                    "PYTHONHASHSEED if they run with one")
    # A restarted engine binds new ones.
    kv_events_resync_s: Annotated[float, Flag(PREFIX)] = Field(
        5.0, gt=0, description="how often each node's KV event endpoints are read")
    tokenize_timeout_s: Annotated[float, Flag(PREFIX)] = Field(
        0.5, gt=0, description="the longest a request waits for a node's /tokenize before it "
                               "is placed without it")
    # Checked against a D's /tokenize now and then (appliance.proxy.prefix.tokenizer). A
    # folder without a tokenizer.json: the proxy warns at its start (the folder is read where
    # the proxy runs, not where its settings are rendered).
    tokenizer: Annotated[str | None, Flag(PREFIX, metavar="FOLDER")] = Field(
        None, description="the model's tokenizer folder (tokenizer.json, its chat template): "
                          "tokenize prompts in process instead of asking a D's /tokenize")
    # pdctl, compose and the chart pass it; an event's size wins over this one.
    kv_block_size: Annotated[int | None, Flag(PREFIX, metavar="TOKENS")] = Field(
        None, ge=1, description="the engines' --block-size: the index predicts from a node's "
        "first requests (default: learned from its first KV event)")

    # OpenTelemetry (appliance.proxy.tracing); P and D must export the same way.
    otlp_traces_endpoint: Annotated[str | None, Flag(TRACING, metavar="URL")] = Field(
        None, description="export a trace per request over OTLP (off without one)")
    otlp_traces_protocol: Annotated[Literal["grpc", "http/protobuf"], Flag(TRACING)] = Field(
        "grpc", description="vLLM's default unless told")
    otlp_traces_sample_ratio: Annotated[float, Flag(TRACING, metavar="RATIO")] = Field(
        1.0, ge=0, le=1, description="the share of requests traced, each a whole trace with "
                                     "P's and D's spans")

    api_keys: Annotated[list[str], Flag(SECURITY, name="api-key", metavar="KEY",
                                        env=API_KEYS_ENV)] = Field(
        default_factory=list, description="accepted Bearer key for the /v1/ routes; none: "
                                          "no auth")
    auth_ops_endpoints: Annotated[bool, Flag(SECURITY)] = Field(
        False, description="also require a key on /metrics and /status; /health stays open")
    # Never the client's key.
    backend_api_key: Annotated[str | None, Flag(SECURITY, metavar="KEY")] = Field(
        None, description="sent to P and D as a Bearer token (their --api-key)")
    backend_api_key_file: Annotated[str | None, Flag(SECURITY, metavar="FILE")] = Field(
        None, description="file holding the key P and D require (read when "
                          "--backend-api-key is unset)")
    bootstrap_token: Annotated[str | None, Flag(SECURITY, metavar="TOKEN")] = Field(
        None, description="the bootstrap sidecars' token (their /query needs it)")
    bootstrap_token_file: Annotated[str | None, Flag(SECURITY, metavar="FILE")] = Field(
        None, description="file holding the bootstrap sidecars' token (read when "
                          "--bootstrap-token is unset)")
    side_channel_key_file: Annotated[str | None, Flag(SECURITY, metavar="FILE")] = Field(
        None, description="ZMQ CURVE secret of the node's side channels (KV releases to P)")

    # Client-facing: both files, or neither.
    tls_cert_file: Annotated[str | None, Flag(TLS, metavar="FILE")] = Field(
        None, description="serve HTTPS with this certificate")
    tls_key_file: Annotated[str | None, Flag(TLS, metavar="FILE")] = Field(
        None, description="... and this private key")
    upstream_ca_file: Annotated[str | None, Flag(TLS, metavar="FILE")] = Field(
        None, description="CA bundle for https:// prefill, decode and bootstrap URLs "
                          "(default: the system's CAs)")

    log_level: Annotated[str, Flag(LOGGING)] = Field("INFO", description="the log's level")
    log_requests: Annotated[bool, Flag(LOGGING)] = Field(
        True, description="one log line per request; off in benchmarks")

    @model_validator(mode="after")
    def _discovery(self, info: ValidationInfo) -> ProxySettings:
        if self.discovery == "kubernetes":
            if self.prefill or self.decode:
                raise ValueError("--discovery kubernetes finds P and D itself: give no "
                                 "--prefill or --decode (no prefill/decode lists)")
            environ = (info.context or {}).get("environ", os.environ)
            self.kubernetes.resolve(environ)
        return self

    @model_validator(mode="after")
    def _files(self) -> ProxySettings:
        if self.backend_api_key is None and self.backend_api_key_file:
            self.backend_api_key = keys.read(self.backend_api_key_file,
                                             "backend_api_key_file")
        if self.bootstrap_token is None and self.bootstrap_token_file:
            self.bootstrap_token = keys.read(self.bootstrap_token_file,
                                             "bootstrap_token_file")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.prefill_timeout_s, self.kv_transfer_s)

    def listener_ssl(self) -> ssl.SSLContext | None:
        """The client-facing TLS context, or None for plain HTTP."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_cert_file/tls_key_file: {exc}") from None
        return ctx

    def upstream_ssl(self) -> ssl.SSLContext:
        """How https:// upstreams are verified: upstream_ca_file, else the system's CAs."""
        try:
            return ssl.create_default_context(cafile=self.upstream_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"upstream_ca_file {self.upstream_ca_file}: {exc}") from None


def load_toml(path: Path) -> dict[str, Any]:
    """A proxy config file: top-level keys, or a `[proxy]` table in a shared appliance file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ValueError("reading a TOML config needs Python 3.11+ or tomli") from None
    with path.open("rb") as f:
        data = tomllib.load(f)
    if isinstance(data.get("proxy"), dict):
        data = data["proxy"]
    return data


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m appliance.proxy",
        description="PD proxy: splits each request into a prefill (P) and a decode (D) request.",
    )
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML file with ProxySettings keys (top level or under [proxy])")
    modelflags.add_flags(p, ProxySettings)
    return p


def load_settings(argv: Sequence[str] | None = None,
                  environ: dict[str, str] | None = None) -> ProxySettings:
    """Config file first, then environment, then flags; raises pydantic.ValidationError."""
    args = vars(build_parser().parse_args(argv))
    environ = os.environ if environ is None else environ
    config: Path | None = args.pop("config")
    data: dict[str, Any] = load_toml(config) if config else {}
    modelflags.given(ProxySettings, args, environ, data)
    return ProxySettings.model_validate(data, context={"environ": environ})
