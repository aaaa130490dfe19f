"""One TOML file per host: the node's stack, model, GPUs or CPUs, transport, ports,
timeouts and images.

`stack = "gpu"` (the CUDA images, NVIDIA GPUs, RDMA or TCP) or `stack = "cpu"` (the CPU
images, P and D on CPUs of their own, TCP).

Structural problems come from pydantic, cross-field ones from `HostConfig.problems()`, and
problems that need the host (a GPU index or RDMA device that does not exist) from
`appliance.pdctl.host.check.host_problems()`; `appliance.pdctl.config.toml` writes the file.
Each problem is one line: `<field>: <what is wrong>`. The sections are in
`appliance.pdctl.config.hostsections` (host, model, devices) and
`appliance.pdctl.config.sections` (the rest); this module puts them together
(`HostConfig`) and reads the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError

from appliance.pdctl.config.hostsections import (
    CpusSection,
    GpusSection,
    HostSection,
    InstanceLists,
    ModelSection,
)
from appliance.pdctl.config.proxysection import ProxySection
from appliance.pdctl.config.sections import (
    VERSION_TAG,
    AuthSection,
    ComposeSection,
    ImagesSection,
    ObservabilitySection,
    PortsSection,
    Section,
    TimeoutsSection,
    TlsSection,
    TracingSection,
    TransferSection,
)
from appliance.pdctl.errors import ConfigError
from appliance.process import DECODE_PREFILL_CHUNK, ENGINE_STEP_TOKENS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_CONFIG = Path("/etc/pd-appliance/host.toml")
CONFIG_ENV = "PDCTL_CONFIG"
Stack = Literal["gpu", "cpu"]
# The CPU build's attention backend works on blocks of a multiple of 32 tokens.
DEFAULT_BLOCK_SIZE = {"gpu": 16, "cpu": 32}


# vLLM's default max_num_seqs on CPU: its step budget may not be smaller.
CPU_MAX_NUM_SEQS = 128


class ClusterPart(InstanceLists):
    """This host's part of a cluster: `pdctl render --cluster` writes it from the cluster
    description (edit that, not this). Absent: the host is a 1P1D node (gpus / cpus)."""

    cluster: str = ""  # the description it came from, for the reader
    proxy: bool = False  # the proxy runs here (its settings: [proxy])
    # The proxy's backends (where it runs): P as "URL,BOOTSTRAP_URL", D as "URL".
    prefill_backends: list[str] = Field(default_factory=list)
    decode_backends: list[str] = Field(default_factory=list)
    # The sidecars this host's D instances accept bootstraps from (every host's with a P).
    sidecars: list[str] = Field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        if not (self.prefill or self.decode or self.proxy):
            out.append("cluster: this host runs nothing (no prefill, decode or proxy)")
        if self.proxy and not (self.prefill_backends and self.decode_backends):
            out.append("cluster.prefill_backends / decode_backends: the proxy runs here and "
                       "needs both (render the host configs from the cluster description)")
        if self.decode and not self.sidecars:
            out.append("cluster.sidecars: decode runs here and must know which bootstrap "
                       "sidecars to accept")
        return out


def engine_id(host: str, role: str, index: int) -> str:
    """A cluster instance's engine id (a 1P1D node's are `<host>-<role>`)."""
    return f"{host}-{role}-{index}"


class HostConfig(Section):
    stack: Stack = "gpu"
    host: HostSection
    model: ModelSection
    gpus: GpusSection = Field(default_factory=GpusSection)
    cpus: CpusSection = Field(default_factory=CpusSection)
    transfer: TransferSection = Field(default_factory=TransferSection)
    ports: PortsSection = Field(default_factory=PortsSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    auth: AuthSection = Field(default_factory=AuthSection)
    tls: TlsSection = Field(default_factory=TlsSection)
    images: ImagesSection = Field(default_factory=ImagesSection)
    compose: ComposeSection = Field(default_factory=ComposeSection)
    proxy: ProxySection = Field(default_factory=ProxySection)
    tracing: TracingSection = Field(default_factory=TracingSection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)
    cluster: ClusterPart | None = None

    def instances(self, role: str) -> list[list[int]]:
        """The device list of each `role` instance this host runs (a 1P1D node: one each)."""
        if self.cluster is not None:
            return getattr(self.cluster, role)
        return [getattr(self.cpus if self.stack == "cpu" else self.gpus, role)]

    def service_ports(self) -> dict[str, int]:
        """Each service this host runs -> the port it listens on, in start order (sidecars,
        P and D, the proxy): a 1P1D node's four, or a cluster host's `<role>-<i>`."""
        if self.cluster is None:
            return {name: self.ports.of(name) for name in ("bootstrap", "prefill", "decode",
                                                            "proxy")}
        out = {f"{svc}-{n}": self.ports.of(svc, n) for svc in ("bootstrap", "prefill", "decode")
               for n in range(len(self.instances("prefill" if svc == "bootstrap" else svc)))}
        if self.cluster.proxy:
            out["proxy"] = self.ports.proxy
        return out

    def device_fields(self) -> list[tuple[str, list[int]]]:
        """(field, devices) of every instance this host runs, as problems name them."""
        if self.cluster is not None:
            return [(f"cluster.{role}[{n}]", devices) for role in ("prefill", "decode")
                    for n, devices in enumerate(getattr(self.cluster, role))]
        section = "cpus" if self.stack == "cpu" else "gpus"
        return [(f"{section}.{role}", self.instances(role)[0]) for role in ("prefill", "decode")]

    @property
    def block_size(self) -> int:
        return self.model.block_size or DEFAULT_BLOCK_SIZE[self.stack]

    @property
    def decode_prefill_chunk(self) -> int:
        chunk = self.model.decode_prefill_chunk
        return DECODE_PREFILL_CHUNK[self.stack] if chunk is None else chunk

    @property
    def max_num_batched_tokens(self) -> int:
        """Each engine's token budget per step (0: vLLM's own)."""
        tokens = self.model.max_num_batched_tokens
        return ENGINE_STEP_TOKENS[self.stack] if tokens is None else tokens

    @property
    def vllm_image(self) -> str:
        if self.images.vllm:
            return self.images.vllm
        return f"pd-appliance/{'vllm-cpu' if self.stack == 'cpu' else 'vllm'}:{VERSION_TAG}"

    @property
    def prefill_engine_id(self) -> str:
        return f"{self.host.name}-prefill"

    @property
    def decode_engine_id(self) -> str:
        return f"{self.host.name}-decode"

    def problems(self) -> list[str]:
        """Cross-field problems, one line each."""
        out = self.proxy.managed()
        ports = self.ports.model_dump()
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                out.append(f"ports.{name}: {port} is also ports.{seen[port]}")
            else:
                seen[port] = name
        out += self._gpu_problems() if self.stack == "gpu" else self._cpu_problems()
        if self.cluster is not None:
            out += self.cluster.problems() + self._instance_problems()
        if self.compose.bind not in ("0.0.0.0", "127.0.0.1", self.host.ip):
            out.append(f"compose.bind: {self.compose.bind} must be 0.0.0.0, 127.0.0.1 or "
                       f"host.ip ({self.host.ip})")
        first, last = self.transfer.port_range
        inside = [f"ports.{n} ({p})" for n, p in ports.items() if first <= p <= last]
        if inside:
            out.append(f"transfer.port_range: {first}-{last} holds {', '.join(inside)}")
        if (self.tls.cert_file is None) != (self.tls.key_file is None):
            out.append("tls: cert_file and key_file go together (HTTPS on the proxy)")
        if self.stack == "gpu" and self.transfer.protocol == "rdma":
            for role in ("prefill", "decode"):
                if not self.transfer.devices(role):
                    out.append(f"transfer.device: required when transfer.protocol is rdma "
                               f"and transfer.{role}_devices is empty (e.g. mlx5_0; "
                               "`pdctl init` lists this host's devices)")
                    break
        return out

    def _instance_problems(self) -> list[str]:
        """A cluster host: no device in two instances, each GPU instance TP devices wide."""
        out: list[str] = []
        owner: dict[int, str] = {}
        kind = "GPU" if self.stack == "gpu" else "CPU"
        ports = {self.ports.proxy: "ports.proxy"}
        for role in ("prefill", "decode"):
            for n, devices in enumerate(self.instances(role)):
                where = f"cluster.{role}[{n}]"
                if self.stack == "gpu" and len(devices) != self.model.tp(role):
                    out.append(f"{where}: {len(devices)} GPUs for a {role} TP size of "
                               f"{self.model.tp(role)}")
                for dev in devices:
                    if dev in owner:
                        out.append(f"{where}: {kind} {dev} is also {owner[dev]}")
                    owner.setdefault(dev, where)
                for port_of in (role, "bootstrap") if role == "prefill" else (role,):
                    port = self.ports.of(port_of, n)
                    if port in ports:
                        out.append(f"{where}: port {port} (ports.{port_of} + {n}) is also "
                                   f"{ports[port]}'s")
                    ports.setdefault(port, where)
        return out

    def _gpu_problems(self) -> list[str]:
        out = []
        if self.model.kv_cache_bytes is not None:
            out.append("model.kv_cache_bytes: only for stack \"cpu\" (on GPUs vLLM sizes the "
                       "KV cache from model.gpu_memory_utilization)")
        if self.cluster is not None:  # its instances are checked instead of gpus
            return out
        for gpu in self.gpus.prefill:
            if gpu in self.gpus.decode:
                out.append(f"gpus.decode: GPU {gpu} is also in gpus.prefill (P and D need "
                           f"GPUs of their own)")
        for role in ("prefill", "decode"):
            n, tp = len(getattr(self.gpus, role)), self.model.tp(role)
            if n != tp:
                out.append(f"gpus.{role}: {n} GPU{'s' if n != 1 else ''} for a {role} TP "
                           f"size of {tp} (give exactly that many GPUs)")
        return out

    def _cpu_problems(self) -> list[str]:
        out = []
        if self.transfer.protocol != "tcp":
            out.append('transfer.protocol: must be "tcp" with stack "cpu" (RDMA moves GPU '
                       'memory; the CPU build moves KV over TCP)')
        if self.block_size % 32:
            out.append(f"model.block_size: {self.block_size} with stack \"cpu\" (the CPU "
                       f"attention backend needs a multiple of 32)")
        if 0 < self.max_num_batched_tokens < CPU_MAX_NUM_SEQS:
            out.append(f"model.max_num_batched_tokens: {self.max_num_batched_tokens} is less "
                       f"than vLLM's {CPU_MAX_NUM_SEQS} requests a step on CPU (0: vLLM's "
                       f"own budget)")
        if self.cluster is not None:  # its instances are checked instead of cpus
            return out
        for role in ("prefill", "decode"):
            if not getattr(self.cpus, role):
                out.append(f"cpus.{role}: required with stack \"cpu\" (the CPUs {role} runs "
                           f"on, e.g. [0, 1]; `pdctl init --stack cpu` splits this host's)")
        both = sorted(set(self.cpus.prefill) & set(self.cpus.decode))
        if both:
            out.append(f"cpus.decode: CPU {both[0]} is also in cpus.prefill (P and D need CPUs "
                       f"of their own: D spins while it waits for KV)")
        return out


# ---- loading ----------------------------------------------------------------------------

def default_config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        kind = err["type"]
        if kind == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        elif kind == "missing":
            lines.append(f"{loc}: required")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if kind == "value_error" or isinstance(got, (dict, list)) \
                else f" (got {got!r})"
            lines.append(f"{loc}: {msg}{shown}")
    return lines


_Checked = TypeVar("_Checked", bound=Section)


def validated(cls: type[_Checked], data: dict[str, Any]) -> _Checked:
    """`cls` from a mapping, structure then its cross-field problems(); ConfigError lists
    every problem, one per line."""
    try:
        obj = cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc)) from None
    problems = obj.problems()
    if problems:
        raise ConfigError(problems)
    return obj


def parse_config(data: dict[str, Any]) -> HostConfig:
    """Validate a host config mapping (see validated)."""
    return validated(HostConfig, data)


def read_toml(path: Path, missing: str) -> dict[str, Any]:
    """A TOML file's mapping; ConfigError (one line) when it cannot be read."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: {missing}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load_validated(cls: type[_Checked], path: Path, missing: str) -> _Checked:
    """`cls` from a TOML file; each problem line starts with the file's path."""
    data = read_toml(path, missing)
    try:
        return validated(cls, data)
    except ConfigError as exc:
        raise ConfigError([f"{path}: {line}" for line in exc.lines]) from None


def load_config(path: Path) -> HostConfig:
    return load_validated(HostConfig, path, "no such config file (write one with `pdctl init`)")
