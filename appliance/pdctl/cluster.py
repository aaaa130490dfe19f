"""A cluster description (one TOML file): the hosts, which P and D instances each runs on
which GPUs (or CPUs), and where the proxy runs; and the plan it implies: every instance's
address and engine id, each host's bootstrap sidecar, the proxy's backend list, and the
sidecars each D must accept bootstraps from.

    stack = "gpu"
    [model]                  # as in a host config
    path = "/models/llama"
    tp_size = 1
    [proxy]
    host = "a"
    [[hosts]]
    name = "a"
    ip = "10.0.0.11"
    gpus = 8                 # what the host has
    prefill = [[0], [1]]     # one list per P instance: its GPUs (TP of them)
    decode = [[2]]

Instance i of a role on a host listens on `ports.<role> + i`; a host with a P runs one
sidecar on `ports.bootstrap`. Problems come one line each (`parse_cluster`). Bringing the
plan up on each host (`pdctl render --cluster`) builds on this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from appliance.netaddr import host_port
from appliance.pdctl.config import (
    HostSection,
    ModelSection,
    PortsSection,
    Stack,
    TransferSection,
    load_validated,
    validated,
)
from appliance.pdctl.sections import _Section

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
Devices = list[Annotated[int, Field(ge=0)]]


class ClusterHost(HostSection):
    gpus: int = Field(0, ge=0, le=64)  # the host's GPUs (stack "gpu")
    cpus: int = Field(0, ge=0, le=4096)  # the host's CPUs (stack "cpu")
    prefill: list[Devices] = Field(default_factory=list)
    decode: list[Devices] = Field(default_factory=list)

    @field_validator("prefill", "decode")
    @classmethod
    def _nonempty(cls, v: list[Devices]) -> list[Devices]:
        if any(not devices for devices in v):
            raise ValueError("each instance needs at least one GPU (or CPU)")
        return v


class ProxyPlacement(_Section):
    host: str
    policy: Literal["round_robin", "least_outstanding"] = "round_robin"


class ClusterDescription(_Section):
    stack: Stack = "gpu"
    model: ModelSection
    proxy: ProxyPlacement
    hosts: list[ClusterHost] = Field(min_length=1)
    ports: PortsSection = Field(default_factory=PortsSection)
    transfer: TransferSection = Field(default_factory=TransferSection)

    def problems(self) -> list[str]:
        """Cross-field problems, one line each."""
        out: list[str] = []
        seen: dict[tuple[str, str], int] = {}
        for i, h in enumerate(self.hosts):
            for key in ("name", "ip"):
                value = getattr(h, key)
                if (key, value) in seen:
                    out.append(f"hosts[{i}].{key}: {value} is also hosts[{seen[key, value]}]")
                else:
                    seen[key, value] = i
            out += self._device_problems(i, h)
            out += self._port_problems(i, h)
        for role in ROLES:
            if not any(getattr(h, role) for h in self.hosts):
                out.append(f"hosts: no {role} instance in the cluster (a cluster needs P "
                           f"and D)")
        names = [h.name for h in self.hosts]
        if self.proxy.host not in names:
            out.append(f"proxy.host: {self.proxy.host} is not one of the hosts "
                       f"({', '.join(names)})")
        return out

    def _device_problems(self, i: int, h: ClusterHost) -> list[str]:
        kind, have = ("GPU", h.gpus) if self.stack == "gpu" else ("CPU", h.cpus)
        out = []
        owner: dict[int, str] = {}
        for role in ROLES:
            for n, devices in enumerate(getattr(h, role)):
                where = f"hosts[{i}].{role}[{n}]"
                if self.stack == "gpu" and len(devices) != self.model.tp(role):
                    out.append(f"{where}: {len(devices)} GPUs for a {role} TP size of "
                               f"{self.model.tp(role)}")
                for dev in devices:
                    if dev >= have:
                        out.append(f"{where}: {kind} {dev} is past the host's {have} "
                                   f"({h.name} has {kind}s 0-{have - 1})" if have else
                                   f"{where}: {h.name} has no {kind}s (set hosts[{i}]."
                                   f"{kind.lower()}s)")
                    elif dev in owner:
                        out.append(f"{where}: {kind} {dev} is also {owner[dev]} "
                                   f"(over-committed)")
                    else:
                        owner[dev] = f"{role}[{n}]"
        return out

    def _port_problems(self, i: int, h: ClusterHost) -> list[str]:
        used: dict[int, str] = {}
        if h.prefill:
            used[self.ports.bootstrap] = "the bootstrap sidecar"
        if h.name == self.proxy.host:
            used.setdefault(self.ports.proxy, "the proxy")
        out = []
        for role in ROLES:
            for n in range(len(getattr(h, role))):
                port = getattr(self.ports, role) + n
                if port in used:
                    out.append(f"hosts[{i}].{role}[{n}]: port {port} is also {used[port]}'s "
                               f"(instance i listens on ports.{role} + i: set the ports "
                               f"further apart)")
                else:
                    used[port] = f"{role}[{n}]"
        return out

    def plan(self) -> ClusterPlan:
        instances = []
        for h in self.hosts:
            for role in ROLES:
                for n, devices in enumerate(getattr(h, role)):
                    instances.append(Instance(
                        host=h.name, role=role, index=n, devices=tuple(devices),
                        url=f"http://{host_port(h.ip, getattr(self.ports, role) + n)}",
                        engine_id=f"{h.name}-{role}-{n}",
                        bootstrap_url=(f"http://{host_port(h.ip, self.ports.bootstrap)}"
                                       if role == "prefill" else None)))
        proxy_host = next(h for h in self.hosts if h.name == self.proxy.host)
        return ClusterPlan(tuple(instances),
                           proxy_url=f"http://{host_port(proxy_host.ip, self.ports.proxy)}",
                           proxy_host=proxy_host.name, policy=self.proxy.policy)


@dataclass(frozen=True)
class Instance:
    host: str
    role: Role
    index: int
    devices: tuple[int, ...]
    url: str
    engine_id: str
    bootstrap_url: str | None  # P: its host's sidecar


@dataclass(frozen=True)
class ClusterPlan:
    instances: tuple[Instance, ...]
    proxy_url: str
    proxy_host: str
    policy: str

    def of(self, role: Role, host: str | None = None) -> list[Instance]:
        return [i for i in self.instances if i.role == role and host in (None, i.host)]

    @property
    def sidecars(self) -> list[str]:
        """Every host's bootstrap sidecar (hosts with a P): what each D must accept."""
        return sorted({i.bootstrap_url for i in self.of("prefill") if i.bootstrap_url})

    def proxy_args(self) -> list[str]:
        """The proxy's backends, as its command line names them."""
        args = ["--policy", self.policy]
        for p in self.of("prefill"):
            args += ["--prefill", f"{p.url},{p.bootstrap_url}"]
        for d in self.of("decode"):
            args += ["--decode", d.url]
        return args


def load_cluster(path: Path) -> ClusterDescription:
    return load_validated(ClusterDescription, path, "no such cluster description")


def parse_cluster(data: dict[str, Any]) -> ClusterDescription:
    """Validate a cluster description; ConfigError lists every problem, one per line."""
    return validated(ClusterDescription, data)
