"""The host config's node-facing sections (transfer, ports, timeouts, auth, TLS, images,
compose) and the pieces every section shares; `appliance.pdctl.config.hostconfig` puts
them together."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from appliance.deadlines import (
    DEFAULT_PREFILL_S,
    DEFAULT_TRANSFER_S,
    WRITE_MARGIN_MAX_S,
    Deadlines,
)

VERSION_TAG = "0.1.0"

Port = Annotated[int, Field(ge=1, le=65535)]
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNSAFE = re.compile(r"[\s'\"$`\\]")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def problems(self) -> list[str]:
        """Cross-field problems, one line each (a whole config's; a section has none)."""
        return []


def safe_path(value: str, what: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{what} must be an absolute path")
    if _UNSAFE.search(value):
        raise ValueError(f"{what} must not contain spaces, quotes, '$' or backslashes")
    return value.rstrip("/") or "/"


def _optional_file(value: str | None) -> str | None:
    return None if value is None else safe_path(value, "the file")


class TransferSection(Section):
    # Set explicitly: "rdma" on GPU hosts with RDMA NICs, "tcp" anywhere else.
    protocol: Literal["rdma", "tcp"] = "rdma"
    # The RDMA devices Mooncake may use (its `device_name`, comma-joined): given several, it
    # takes for each GPU buffer the nearest of them. Per role, `pdctl init` lists the NICs
    # nearest that role's GPUs (README, "Which NIC each GPU uses"); `device` (one name or a
    # comma-separated list) serves a role whose own list is empty.
    device: str = ""
    prefill_devices: list[str] = Field(default_factory=list)
    decode_devices: list[str] = Field(default_factory=list)
    # How the NIC reaches GPU memory: the nvidia_peermem module, DMA-BUF (NVIDIA's open
    # kernel modules), or auto: the container's preflight takes the one it finds usable
    # (peermem first) and tells Mooncake (images/base/pd-entrypoint.sh).
    gpudirect: Literal["auto", "peermem", "dmabuf"] = "auto"
    # Mooncake's handshake and TCP data ports (two per worker) come from this range. Mooncake
    # listens on every address and cannot be told otherwise, and its endpoints read and write
    # the memory a request names: firewall this range to the cluster network (README).
    port_range: tuple[Port, Port] = (17000, 17199)

    @field_validator("port_range")
    @classmethod
    def _range(cls, v: tuple[int, int]) -> tuple[int, int]:
        if v[1] - v[0] < 31:
            raise ValueError("needs at least 32 ports, first to last (two per worker)")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        names = [d.strip() for d in v.split(",")] if v else []
        return ",".join(_device_names(names))

    @field_validator("prefill_devices", "decode_devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        return _device_names(v)

    def listed(self) -> dict[str, list[str]]:
        """Each device field's names: `device` split at its commas, then the roles' lists."""
        return {"device": [d for d in self.device.split(",") if d],
                "prefill_devices": self.prefill_devices, "decode_devices": self.decode_devices}

    def devices(self, role: str) -> list[str]:
        """The RDMA devices of "prefill" or "decode": its own list, else `device`'s."""
        fields = self.listed()
        return fields[f"{role}_devices"] or fields["device"]

    def device_name(self, role: str) -> str:
        """Mooncake's `device_name` for a role's engines: its NICs comma-joined, "" on tcp."""
        return ",".join(self.devices(role)) if self.protocol == "rdma" else ""


def _device_names(names: list[str]) -> list[str]:
    for name in names:
        if not NAME.match(name):
            raise ValueError(f"{name!r} is not an RDMA device name (e.g. mlx5_0)")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{dup[0]} is listed twice")
    return names


class PortsSection(Section):
    proxy: Port = 8000
    prefill: Port = 8010
    decode: Port = 8020
    bootstrap: Port = 8998

    def of(self, service: str, index: int = 0) -> int:
        """Where instance `index` of "prefill", "decode" or "bootstrap" (P index's sidecar)
        listens: the role's port + index."""
        return int(getattr(self, service)) + index


class TimeoutsSection(Section):
    # How long `pdctl up` waits for every service to be healthy (first start loads weights).
    startup_s: float = Field(900.0, gt=0)
    # The proxy's wait for P's answer: what D and P wait derives from it and from
    # kv_transfer_s (appliance.deadlines). kv_recv_s and kv_send_s are the connector's
    # defaults for callers that send no deadline of their own; unset, derived too.
    prefill_s: float = Field(DEFAULT_PREFILL_S, gt=0)
    kv_transfer_s: float = Field(DEFAULT_TRANSFER_S, ge=WRITE_MARGIN_MAX_S)
    decode_read_s: float = Field(300.0, gt=0)
    kv_recv_s: float | None = Field(None, gt=0)
    kv_send_s: float | None = Field(None, gt=0)
    bootstrap_ttl_s: float = Field(30.0, ge=0)

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.prefill_s, self.kv_transfer_s)

    @property
    def recv_s(self) -> float:
        return self.kv_recv_s or self.deadlines.recv_s

    @property
    def send_s(self) -> float:
        return self.kv_send_s or self.deadlines.send_s


class AuthSection(Section):
    # Clients' keys, one per line; the proxy then requires `Authorization: Bearer <key>` on
    # /v1/*. The node's own keys (P's and D's api key, the bootstrap token, the side
    # channels' CURVE key) are always on: `pdctl init` (and render) write them to keys/
    # beside the rendered files (appliance.keys).
    api_keys_file: str | None = None
    # Also ask a client key on the proxy's /metrics and /status (/health stays open).
    protect_ops_endpoints: bool = False
    # Deprecated override of keys/bootstrap-token.
    bootstrap_token_file: str | None = None

    @field_validator("api_keys_file", "bootstrap_token_file")
    @classmethod
    def _files(cls, v: str | None) -> str | None:
        return _optional_file(v)


class TlsSection(Section):
    # HTTPS on the proxy's client-facing listener: both files (inside the config directory,
    # which the proxy's container mounts), or neither.
    cert_file: str | None = None
    key_file: str | None = None

    @field_validator("cert_file", "key_file")
    @classmethod
    def _files(cls, v: str | None) -> str | None:
        return _optional_file(v)


class ImagesSection(Section):
    # Default: pd-appliance/vllm (GPU stack) or pd-appliance/vllm-cpu (CPU stack).
    vllm: str | None = None
    slim: str = f"pd-appliance/slim:{VERSION_TAG}"

    @field_validator("vllm", "slim")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[a-z0-9][a-z0-9._/:@-]*$", v):
            raise ValueError(f"{v!r} is not an image reference")
        return v


class TracingSection(Section):
    """Traces (OpenTelemetry, appliance.observability.tracing): off unless an OTLP endpoint
    is set; then P and D (vLLM's spans and the connector's) and the proxy export there."""

    otlp_endpoint: str | None = None  # e.g. http://10.0.0.5:4317 (grpc)
    protocol: Literal["grpc", "http/protobuf"] = "grpc"
    # The share of requests traced, whole (the proxy decides; P and D follow).
    sample_ratio: float = Field(1.0, ge=0, le=1)

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+(/\S*)?$", v):
            raise ValueError(f"{v!r} is not an http:// or https:// URL")
        return v

    def vllm_args(self) -> list[str]:
        return ["--otlp-traces-endpoint", self.otlp_endpoint] if self.otlp_endpoint else []

    def proxy_settings(self) -> dict[str, object]:
        """The proxy's settings for these (none when tracing is off)."""
        return ({"otlp_traces_endpoint": self.otlp_endpoint,
                 "otlp_traces_protocol": self.protocol,
                 "otlp_traces_sample_ratio": self.sample_ratio} if self.otlp_endpoint else {})


class ObservabilitySection(Section):
    """compose's `observability` profile: the node's own Prometheus and Grafana
    (appliance.pdctl.node.observability)."""

    enabled: bool = False
    listen: str = "127.0.0.1"
    prometheus_port: Port = 9090
    grafana_port: Port = 3000
    prometheus_image: str = "prom/prometheus:v3.5.0"
    grafana_image: str = "grafana/grafana:12.1.0"

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None
        return v


class ComposeSection(Section):
    project: str = "pd-appliance"
    shm_size: str = "16g"
    # The proxy's client-facing address (every address by default). P, D and the bootstrap
    # sidecar listen on host.ip only.
    bind: str = "0.0.0.0"
    restart: Literal["unless-stopped", "always", "on-failure", "no"] = "unless-stopped"

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        if not re.match(r"^[a-z0-9][a-z0-9_-]*$", v):
            raise ValueError("must be lowercase letters, digits, '_' or '-'")
        return v

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str) -> str:
        if not re.match(r"^[1-9][0-9]*[bkmg]?$", v.lower()):
            raise ValueError(f"{v!r} is not a size (e.g. 16g)")
        return v.lower()

    @field_validator("bind")
    @classmethod
    def _bind(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None
