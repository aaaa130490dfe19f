"""Typed settings of the proxy: a TOML file and CLI flags, the flags winning."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from appliance import keys
from appliance.deadlines import (
    DEFAULT_PREFILL_S,
    DEFAULT_TRANSFER_S,
    WRITE_MARGIN_MAX_S,
    Deadlines,
)
from appliance.netaddr import host_port
from appliance.proxy.k8s_settings import DEFAULT_BOOTSTRAP_PORT, KubernetesSettings, http_url

# Adaptive disaggregation's policy (appliance.proxy.placement).
Split = Literal["always", "never", "auto"]
# Which P and D serve a request (appliance.proxy.placement.routing).
RoutingPolicy = Literal["round_robin", "least_outstanding", "cache_aware", "cache_aware_sglang"]

DEFAULT_PORT = 8000
API_KEYS_ENV = "APPLIANCE_PROXY_API_KEYS"


def _node_url(value: str) -> str:
    # http:// on one host or a private network; https:// (vLLM's --ssl-certfile) when the
    # proxy reaches P or D across a network others share (see upstream_ca_file).
    return http_url(value)


class PrefillNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    # Where the proxy reads engine ids, and the address D is told to pull KV through.
    bootstrap_url: str = Field("", validate_default=True)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _node_url(v)

    @field_validator("bootstrap_url")
    @classmethod
    def _bootstrap(cls, v: str, info: ValidationInfo) -> str:
        if v:
            return http_url(v)
        # Default: the sidecar on P's host at the MooncakeConnector's standard port.
        base = urlsplit(info.data.get("url", ""))
        return f"http://{host_port(base.hostname or '', DEFAULT_BOOTSTRAP_PORT)}"


class DecodeNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _node_url(v)


class ProxySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    # static: the prefill and decode lists below; kubernetes: pods found by label
    # (the kubernetes table), the lists left empty.
    discovery: Literal["static", "kubernetes"] = "static"
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    prefill: list[PrefillNode] = Field(default_factory=list)
    decode: list[DecodeNode] = Field(default_factory=list)
    # cache_aware: by the prefix index, against load (appliance.proxy.placement.routing);
    # without the index, round robin.
    policy: RoutingPolicy = "cache_aware"

    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    # Health checks failed in a row after which a node counts as down and the calls it
    # holds fail at once (P's then go to D alone, as when P is unreachable; D's end with an
    # error) instead of at their timeouts: a frozen node answers nothing, ever.
    down_after_failures: int = Field(2, ge=1)
    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest wait for P's answer (P's queue and prefill: P says nothing until its one token
    # is out); past it P's and D's calls are closed (P never computes a prompt still queued)
    # and D alone answers. D's receive deadline and P's hold derive from it and from
    # kv_transfer_s, D's wait beyond it for the write (appliance.deadlines).
    prefill_timeout_s: float = Field(DEFAULT_PREFILL_S, gt=0)
    # Traces (OpenTelemetry, appliance.proxy.tracing): off unless an OTLP endpoint is set;
    # the protocol is vLLM's default unless told (P and D must export the same way).
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] = "grpc"
    # The share of requests traced (each a whole trace, P's and D's spans included).
    otlp_traces_sample_ratio: float = Field(1.0, ge=0, le=1)
    kv_transfer_s: float = Field(DEFAULT_TRANSFER_S, ge=WRITE_MARGIN_MAX_S)
    # Longest silence from D, counted from P's answer (D waits for the KV before it speaks;
    # a non-streaming answer is one long silence).
    decode_read_timeout_s: float = Field(300.0, gt=0)

    # The longest one call to P or D may take, a whole stream included (the timeouts above
    # bound silences); past it the call is cut and the client gets an error.
    upstream_deadline_s: float = Field(1800.0, gt=0)
    # Connections open at once to one node; beyond, a call waits up to connect_timeout_s for
    # one to free up.
    max_connections_per_node: int = Field(1024, ge=1)

    # Overload control (appliance.proxy.admission): requests in flight per decode node (0:
    # no limit); beyond, up to max_queued wait at most queue_timeout_s for a slot, and the
    # rest get 429 with Retry-After at once.
    max_in_flight_per_decode: int = Field(0, ge=0)
    max_queued: int = Field(0, ge=0)
    queue_timeout_s: float = Field(5.0, gt=0)

    # No decode node (or no P, without fallback) in rotation: a request waits this long for
    # one before its 503 (a rollout's handover, a node back from a failed check).
    node_wait_s: float = Field(5.0, ge=0)

    # SIGTERM: requests in flight get this long to finish, then end with an error.
    drain_grace_s: float = Field(30.0, ge=0)

    # P unreachable or timed out: serve by D alone (local prefill) instead of answering 503.
    fallback_to_decode: bool = True
    # P finished its one token with "stop" (EOS or a stop string). This appliance's connector
    # sends the KV whatever the finish reason, so D is left alone. vLLM's built-in
    # MooncakeConnector only sends KV for length-capped requests, and D would wait for KV
    # that never comes (vllm#46008): turn this on to serve such requests by D alone.
    fallback_on_prefill_stop: bool = False

    # Streaming requests: send P's token to the client as soon as P answers, then ask D to
    # continue after it (appliance.proxy.exchange.first_token). TTFT becomes P's alone; the second
    # token comes after the transfer and one D step. Off: D gives every token.
    first_token_from_prefill: bool = True

    # Adaptive disaggregation (appliance.proxy.placement): "always" splits every request
    # (P prefills, D decodes), "never" serves each by D alone, "auto" picks per request by
    # the node's measurements.
    split: Split = "auto"
    # The most a local prefill on D may stall D's running decodes, in ms (auto); unset: 3x
    # D's measured time per token.
    itl_slo_ms: float | None = Field(None, gt=0)
    # What each P and D holds in its prefix cache, from their own KV events
    # (appliance.proxy.prefix): auto weighs only the prompt tokens a node would compute.
    # The engines publish them when started with --kv-events-config (pdctl, compose and
    # the chart do); a node that does not is predicted to hold nothing.
    prefix_index: bool = True
    # The seed of the engines' first block hash: vLLM's default, or their PYTHONHASHSEED.
    prefix_hash_seed: str = Field("vllm-none-hash", min_length=1)
    # How often each node's event endpoints are read (a restarted engine binds new ones).
    kv_events_resync_s: float = Field(5.0, gt=0)
    # The longest a request waits for a node's /tokenize before it is placed without it.
    tokenize_timeout_s: float = Field(0.5, gt=0)
    # The model's tokenizer folder (tokenizer.json, its chat template): prompts are tokenized
    # in the proxy's process, checked against a D's /tokenize now and then
    # (appliance.proxy.prefix.tokenizer). Unset, or a folder without a tokenizer.json (the
    # proxy warns at its start; the folder is read where the proxy runs, not where its
    # settings are rendered): every prompt asks a D's /tokenize.
    tokenizer: str | None = None
    # The engines' KV block size (their --block-size; pdctl, compose and the chart pass it):
    # the index predicts from a node's first requests, before its first KV event has said
    # it. Unset: learned from that event. An event's size wins over this one.
    kv_block_size: int | None = Field(None, ge=1)

    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Bearer keys for the /v1/ routes; empty: no auth.
    api_keys: list[str] = Field(default_factory=list)
    # Also require a key on /metrics and /status (/health stays open).
    auth_ops_endpoints: bool = False
    # Sent to P and D as `Authorization: Bearer` (vLLM's --api-key), never the client's key.
    backend_api_key: str | None = None
    backend_api_key_file: str | None = None  # read into backend_api_key when that is unset
    # The bootstrap sidecars' shared token (their /query needs it).
    bootstrap_token: str | None = None
    bootstrap_token_file: str | None = None
    # ZMQ CURVE secret of the node's side channels (the proxy sends P its releases there).
    side_channel_key_file: str | None = None

    # TLS on the client-facing listener: both files, or neither.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # CA bundle that https:// P, D and bootstrap URLs are verified with (default: the
    # system's).
    upstream_ca_file: str | None = None

    log_level: str = "INFO"
    # One log line per request; off in benchmarks.
    log_requests: bool = True

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


def parse_prefill_flag(value: str) -> dict[str, str]:
    """`URL[,BOOTSTRAP_URL]` -> PrefillNode fields."""
    url, _, bootstrap = value.partition(",")
    return {"url": url, "bootstrap_url": bootstrap}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m appliance.proxy",
        description="PD proxy: splits each request into a prefill (P) and a decode (D) request.",
    )
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML file with ProxySettings keys (top level or under [proxy])")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--discovery", choices=["static", "kubernetes"],
                   help="where P and D come from: --prefill/--decode (static, the default) "
                        "or the Ready pods the --k8s-*-selector flags match")
    k8s = p.add_argument_group("kubernetes discovery")
    k8s.add_argument("--k8s-namespace", metavar="NS",
                     help="default: the pod's own (its service account's namespace file)")
    k8s.add_argument("--k8s-prefill-selector", metavar="SELECTOR",
                     help="label selector of P pods, e.g. app.kubernetes.io/component=prefill")
    k8s.add_argument("--k8s-decode-selector", metavar="SELECTOR",
                     help="label selector of D pods")
    k8s.add_argument("--k8s-prefill-port", type=int, metavar="PORT", help="P's API (8010)")
    k8s.add_argument("--k8s-decode-port", type=int, metavar="PORT", help="D's API (8020)")
    k8s.add_argument("--k8s-bootstrap-port", type=int, metavar="PORT",
                     help="the bootstrap sidecar beside each P (8998)")
    k8s.add_argument("--k8s-api-server", metavar="URL",
                     help="default https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT")
    k8s.add_argument("--k8s-token-file", metavar="FILE",
                     help="bearer token, re-read when it changes (default: the service "
                          "account's)")
    k8s.add_argument("--k8s-ca-file", metavar="FILE",
                     help="CA of the API server (default: the service account's ca.crt)")
    p.add_argument("--prefill", action="append", metavar="URL[,BOOTSTRAP_URL]",
                   help="a prefill node (repeatable); bootstrap defaults to the host's :8998")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode node (repeatable)")
    p.add_argument("--policy", choices=list(RoutingPolicy.__args__),
                   help="which P and D: cache_aware (default: the prefix index against load), "
                        "cache_aware_sglang (SGLang's rule on the same index), round_robin, "
                        "least_outstanding")
    p.add_argument("--health-interval", dest="health_interval_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--health-timeout", dest="health_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--down-after-failures", type=int, metavar="N",
                   help="failed health checks in a row after which a node's calls fail")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--prefill-timeout", dest="prefill_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export a trace per request over OTLP (off by default)")
    p.add_argument("--otlp-traces-protocol", choices=("grpc", "http/protobuf"))
    p.add_argument("--otlp-traces-sample-ratio", type=float, metavar="RATIO",
                   help="the share of requests traced (default 1)")
    p.add_argument("--kv-transfer-timeout", dest="kv_transfer_s", type=float,
                   metavar="SECONDS", help="D's wait for the KV beyond --prefill-timeout")
    p.add_argument("--decode-read-timeout", dest="decode_read_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--upstream-deadline", dest="upstream_deadline_s", type=float,
                   metavar="SECONDS", help="longest any one call to P or D may take")
    p.add_argument("--max-connections-per-node", type=int, metavar="N")
    p.add_argument("--max-in-flight-per-decode", type=int, metavar="N",
                   help="requests in flight per decode node (0: no limit); beyond: 429")
    p.add_argument("--max-queued", type=int, metavar="N",
                   help="requests waiting for a decode slot before 429s start")
    p.add_argument("--queue-timeout", dest="queue_timeout_s", type=float, metavar="SECONDS")
    p.add_argument("--node-wait", dest="node_wait_s", type=float, metavar="SECONDS",
                   help="how long a request waits for a node in rotation before its 503")
    p.add_argument("--drain-grace", dest="drain_grace_s", type=float, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight get to finish")
    p.add_argument("--fallback", dest="fallback_to_decode", action=argparse.BooleanOptionalAction,
                   help="serve by D alone when P is unreachable or times out")
    p.add_argument("--fallback-on-prefill-stop", dest="fallback_on_prefill_stop",
                   action=argparse.BooleanOptionalAction)
    p.add_argument("--first-token-from-prefill", dest="first_token_from_prefill",
                   action=argparse.BooleanOptionalAction,
                   help="stream P's token to the client at once, D continues after it")
    p.add_argument("--split", choices=["always", "never", "auto"],
                   help="always: P prefills every request, D decodes; never: D alone; auto "
                        "(default): per request, the sooner by the node's measurements")
    p.add_argument("--itl-slo-ms", dest="itl_slo_ms", type=float, metavar="MS",
                   help="auto: the most a prefill on D may stall D's decodes (default: 3x "
                        "D's measured time per token)")
    p.add_argument("--prefix-index", dest="prefix_index",
                   action=argparse.BooleanOptionalAction,
                   help="auto: follow each node's KV events to weigh only uncached prompt "
                        "tokens (default on)")
    p.add_argument("--prefix-hash-seed", metavar="SEED",
                   help="the engines' PYTHONHASHSEED, if they run with one")
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="the model's tokenizer folder: tokenize prompts for the prefix index "
                        "in process instead of asking a D's /tokenize")
    p.add_argument("--kv-block-size", dest="kv_block_size", type=int, metavar="TOKENS",
                   help="the engines' --block-size: the prefix index predicts from the first "
                        "requests (default: learned from the first KV event)")
    p.add_argument("--max-body-bytes", type=int, metavar="BYTES")
    p.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                   help=f"accepted Bearer key (repeatable; also ${API_KEYS_ENV}, comma-separated)")
    p.add_argument("--auth-ops-endpoints", action=argparse.BooleanOptionalAction)
    p.add_argument("--backend-api-key", metavar="KEY",
                   help="sent to P and D as a Bearer token (their --api-key)")
    p.add_argument("--backend-api-key-file", metavar="FILE",
                   help="file holding the key P and D require (instead of --backend-api-key)")
    p.add_argument("--bootstrap-token-file", metavar="FILE",
                   help="file holding the bootstrap sidecars' token (their /query needs it)")
    p.add_argument("--side-channel-key-file", metavar="FILE",
                   help="ZMQ CURVE secret of the node's side channels (KV releases to P)")
    p.add_argument("--tls-cert-file", metavar="FILE", help="serve HTTPS with this certificate")
    p.add_argument("--tls-key-file", metavar="FILE", help="... and this private key")
    p.add_argument("--upstream-ca-file", metavar="FILE",
                   help="CA bundle for https:// prefill, decode and bootstrap URLs")
    p.add_argument("--log-level")
    p.add_argument("--log-requests", action=argparse.BooleanOptionalAction)
    return p


def load_settings(argv: Sequence[str] | None = None,
                  environ: dict[str, str] | None = None) -> ProxySettings:
    """Config file first, then environment, then flags; raises pydantic.ValidationError."""
    args = vars(build_parser().parse_args(argv))
    environ = os.environ if environ is None else environ
    config: Path | None = args.pop("config")
    data: dict[str, Any] = load_toml(config) if config else {}
    env_keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if env_keys:
        data["api_keys"] = env_keys
    for key, value in args.items():
        if value is None:
            continue
        if key.startswith("k8s_"):
            data.setdefault("kubernetes", {})[key.removeprefix("k8s_")] = value
            continue
        if key == "prefill":
            value = [parse_prefill_flag(v) for v in value]
        elif key == "decode":
            value = [{"url": v} for v in value]
        data[key] = value
    return ProxySettings.model_validate(data, context={"environ": environ})
