"""Typed settings of the proxy: a TOML file and CLI flags, the flags winning."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DEFAULT_PORT = 8000
DEFAULT_BOOTSTRAP_PORT = 8998
API_KEYS_ENV = "APPLIANCE_PROXY_API_KEYS"


def _http_url(value: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"expected a {'/'.join(schemes)}://host[:port] URL, got {value!r}")
    return value.strip().rstrip("/")


def _node_url(value: str) -> str:
    # vLLM nodes are spoken to in plain HTTP/1.1 by the proxy's own lean client (TLS, if
    # any, ends in front of the proxy); bootstrap URLs may be https.
    return _http_url(value, ("http",))


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
            return _http_url(v)
        # Default: the sidecar on P's host at the MooncakeConnector's standard port.
        base = urlsplit(info.data.get("url", ""))
        host = f"[{base.hostname}]" if base.hostname and ":" in base.hostname else base.hostname
        return f"http://{host}:{DEFAULT_BOOTSTRAP_PORT}"


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
    prefill: list[PrefillNode] = Field(default_factory=list)
    decode: list[DecodeNode] = Field(default_factory=list)
    policy: Literal["round_robin", "least_outstanding"] = "round_robin"

    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest wait for P's answer (P says nothing until its one token is out); past it, P
    # counts as timed out and the fallback applies.
    prefill_timeout_s: float = Field(120.0, gt=0)
    # Longest silence from D, counted from P's answer (D waits for the KV before it speaks;
    # a non-streaming answer is one long silence).
    decode_read_timeout_s: float = Field(300.0, gt=0)

    # P unreachable or timed out: serve by D alone (local prefill) instead of answering 503.
    fallback_to_decode: bool = True
    # P finished its one token with "stop" (EOS or a stop string). This appliance's connector
    # sends the KV whatever the finish reason, so D is left alone. vLLM's built-in
    # MooncakeConnector only sends KV for length-capped requests, and D would wait for KV
    # that never comes (vllm#46008): turn this on to serve such requests by D alone.
    fallback_on_prefill_stop: bool = False

    # Streaming requests: send P's token to the client as soon as P answers, then ask D to
    # continue after it (appliance.proxy.first_token). TTFT becomes P's alone; the second
    # token comes after the transfer and one D step. Off: D gives every token.
    first_token_from_prefill: bool = True

    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Bearer keys for the /v1/ routes; empty: no auth.
    api_keys: list[str] = Field(default_factory=list)
    # Also require a key on /health, /metrics and /status.
    auth_ops_endpoints: bool = False
    # Sent to P and D as `Authorization: Bearer` (vLLM's --api-key), never the client's key.
    backend_api_key: str | None = None

    log_level: str = "INFO"
    # One log line per request; off in benchmarks.
    log_requests: bool = True


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
    p.add_argument("--prefill", action="append", metavar="URL[,BOOTSTRAP_URL]",
                   help="a prefill node (repeatable); bootstrap defaults to the host's :8998")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode node (repeatable)")
    p.add_argument("--policy", choices=["round_robin", "least_outstanding"])
    p.add_argument("--health-interval", dest="health_interval_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--health-timeout", dest="health_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--prefill-timeout", dest="prefill_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--decode-read-timeout", dest="decode_read_timeout_s", type=float,
                   metavar="SECONDS")
    p.add_argument("--fallback", dest="fallback_to_decode", action=argparse.BooleanOptionalAction,
                   help="serve by D alone when P is unreachable or times out")
    p.add_argument("--fallback-on-prefill-stop", dest="fallback_on_prefill_stop",
                   action=argparse.BooleanOptionalAction)
    p.add_argument("--first-token-from-prefill", dest="first_token_from_prefill",
                   action=argparse.BooleanOptionalAction,
                   help="stream P's token to the client at once, D continues after it")
    p.add_argument("--max-body-bytes", type=int, metavar="BYTES")
    p.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                   help=f"accepted Bearer key (repeatable; also ${API_KEYS_ENV}, comma-separated)")
    p.add_argument("--auth-ops-endpoints", action=argparse.BooleanOptionalAction)
    p.add_argument("--backend-api-key", metavar="KEY",
                   help="sent to P and D as a Bearer token (their --api-key)")
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
        if key == "prefill":
            value = [parse_prefill_flag(v) for v in value]
        elif key == "decode":
            value = [{"url": v} for v in value]
        data[key] = value
    return ProxySettings.model_validate(data)
