"""A cluster description (one TOML file): the hosts, which P and D instances each runs on
which GPUs (or CPUs), and where the proxy runs; and the plan it implies: every instance's
address and engine id, each host's bootstrap sidecar, the proxy's backend list, and the
sidecars each D must accept bootstraps from.

    stack = "gpu"
    [model]                  # as in a host config
    path = "/models/llama"
    tp_size = 1
    [proxy]
    host = "a"               # where it runs; the rest: the proxy's own settings
    policy = "cache_aware"   # (ProxySettings' keys, as in a host config's [proxy])
    [[hosts]]
    name = "a"
    ip = "10.0.0.11"
    gpus = 8                 # what the host has
    prefill = [[0], [1]]     # one list per P instance: its GPUs (TP of them)
    decode = [[2]]

Instance i of a role on a host listens on `ports.<role> + i`; P instance i has its own
sidecar on `ports.bootstrap + i`. `[kubernetes] pod_network_cidrs` is for `render
--kubernetes` alone (appliance.pdctl.cluster.helmvalues). Problems come one line each
(`parse_cluster`).
`host_config(name)` is each host's own config (appliance.pdctl.cluster.render writes them);
`pdctl up` there brings up its part.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from appliance.netaddr import host_port
from appliance.pdctl.config.hostconfig import (
    ClusterPart,
    HostConfig,
    Stack,
    engine_id,
    load_validated,
    validated,
)
from appliance.pdctl.config.hostsections import Devices, HostSection, InstanceLists, ModelSection
from appliance.pdctl.config.proxysection import ProxySection
from appliance.pdctl.config.sections import (
    ComposeSection,
    ImagesSection,
    PortsSection,
    Section,
    TimeoutsSection,
    TracingSection,
    TransferSection,
)
from appliance.pdctl.errors import ConfigError

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class ClusterHost(HostSection, InstanceLists):
    gpus: int = Field(0, ge=0, le=64)  # the host's GPUs (stack "gpu")
    cpus: int = Field(0, ge=0, le=4096)  # the host's CPUs (stack "cpu")


class ProxyPlacement(ProxySection):  # type: ignore[misc,valid-type]
    """The description's [proxy]: the host it runs on, and the proxy's own settings (as a
    host config's [proxy]: ProxySettings' keys), given to that host's config."""

    host: str  # not the proxy's listener (pdctl sets that): the cluster host it runs on


def _cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise ValueError(f"{value!r} is not a network (e.g. 10.244.0.0/16)") from None


class KubernetesSection(Section):
    """What only `render --kubernetes` uses. The pod network's CIDRs: D accepts bootstrap
    addresses only there (P pods get a new IP on every restart); each bad one is its own
    line (pod_network_cidrs.<i>)."""
    pod_network_cidrs: list[Annotated[str, AfterValidator(_cidr)]] = Field(
        default_factory=list)


class ClusterDescription(Section):
    stack: Stack = "gpu"
    model: ModelSection
    proxy: ProxyPlacement
    hosts: list[ClusterHost] = Field(min_length=1)
    ports: PortsSection = Field(default_factory=PortsSection)
    transfer: TransferSection = Field(default_factory=TransferSection)
    # Carried into every host's config as they are.
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    tracing: TracingSection = Field(default_factory=TracingSection)
    images: ImagesSection = Field(default_factory=ImagesSection)
    compose: ComposeSection = Field(default_factory=ComposeSection)
    kubernetes: KubernetesSection = Field(default_factory=KubernetesSection)

    @model_validator(mode="before")
    @classmethod
    def _cpu_moves_kv_over_tcp(cls, data: Any) -> Any:
        # The CPU build has one transport: say so once here rather than on every host.
        if isinstance(data, dict) and data.get("stack") == "cpu":
            transfer = data.get("transfer")
            if transfer is None or (isinstance(transfer, dict) and "protocol" not in transfer):
                data = {**data, "transfer": {**(transfer or {}), "protocol": "tcp"}}
        return data

    def host_config(self, name: str, source: str = "") -> HostConfig:
        """The host config of one host: its instances, and where it runs the proxy, the
        proxy's backends; every D accepts every P's sidecar."""
        h = next(h for h in self.hosts if h.name == name)
        plan = self.plan()
        here = h.name == self.proxy.host
        part = ClusterPart(
            cluster=source, prefill=h.prefill, decode=h.decode, proxy=here,
            prefill_backends=plan.prefill_backends if here else [],
            decode_backends=plan.decode_backends if here else [],
            sidecars=plan.sidecars if h.decode else [])
        host = h.model_dump(include=set(HostSection.model_fields))
        if h.prefill and not h.internal_networks:
            # P writes only into a Mooncake session at the address D's request came from;
            # a D host's side channel may leave from another of its addresses than its
            # session's (another NIC, or 127.0.0.1 on one machine), so P also accepts the
            # D hosts' own addresses, and nothing else.
            host["internal_networks"] = sorted({
                str(ipaddress.ip_network(d.ip)) for d in self.hosts if d.decode})
        return validated(HostConfig, {
            "stack": self.stack, "host": host,
            "model": self.model.model_dump(exclude_none=True),
            "transfer": self.transfer.model_dump(), "ports": self.ports.model_dump(),
            "timeouts": self.timeouts.model_dump(),
            "tracing": self.tracing.model_dump(),
            "images": self.images.model_dump(exclude_none=True),
            "compose": self.compose.model_dump(), "cluster": part.model_dump(),
            "proxy": self.proxy.model_dump(exclude_none=True, exclude={"host"}) if here
            else {}})

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
        if not out:  # each host's own config must hold too (what `pdctl up` there checks)
            for i, h in enumerate(self.hosts):
                try:
                    self.host_config(h.name)
                except ConfigError as exc:
                    out += [f"hosts[{i}] ({h.name}): {line}" for line in exc.lines]
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
        if h.name == self.proxy.host:
            used[self.ports.proxy] = "the proxy"
        out = []
        # P instance n has its own sidecar on ports.bootstrap + n (a sidecar holds one
        # engine per dp rank, as vLLM's bootstrap server does).
        for port_of, role, count in (("prefill", "prefill", len(h.prefill)),
                                     ("decode", "decode", len(h.decode)),
                                     ("bootstrap", "prefill", len(h.prefill))):
            for n in range(count):
                port = self.ports.of(port_of, n)
                what = f"{role}[{n}]" + ("'s sidecar" if port_of == "bootstrap" else "")
                if port in used:
                    out.append(f"hosts[{i}].{role}[{n}]: port {port} is also {used[port]}'s "
                               f"(instance i listens on ports.{port_of} + i: set the ports "
                               f"further apart)")
                else:
                    used[port] = what
        return out

    def plan(self) -> ClusterPlan:
        instances = [i for h in self.hosts
                     for i in _instances(h.name, h.ip, self.ports, h.prefill, h.decode)]
        proxy_host = next(h for h in self.hosts if h.name == self.proxy.host)
        return ClusterPlan(tuple(instances),
                           proxy_url=f"http://{host_port(proxy_host.ip, self.ports.proxy)}",
                           proxy_host=proxy_host.name, policy=self.proxy.policy)


def _instances(host: str, ip: str, ports: PortsSection, prefill: list[Devices],
               decode: list[Devices]) -> list[Instance]:
    """One host's instances: where each listens (its sidecar too), its engine id."""
    return [Instance(host=host, role=role, index=n, devices=tuple(devices),
                     url=f"http://{host_port(ip, ports.of(role, n))}",
                     engine_id=engine_id(host, role, n),
                     bootstrap_url=(f"http://{host_port(ip, ports.of('bootstrap', n))}"
                                    if role == "prefill" else None))
            for role, lists in (("prefill", prefill), ("decode", decode))
            for n, devices in enumerate(lists)]


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
    proxy_url: str | None  # None: a host's own plan, the proxy elsewhere
    proxy_host: str
    policy: str | None  # the proxy's routing policy, when the description names one

    def of(self, role: Role, host: str | None = None) -> list[Instance]:
        return [i for i in self.instances if i.role == role and host in (None, i.host)]

    @property
    def sidecars(self) -> list[str]:
        """Every P's bootstrap sidecar: what each D must accept."""
        return sorted({i.bootstrap_url for i in self.of("prefill") if i.bootstrap_url})

    @property
    def prefill_backends(self) -> list[str]:
        """Every P as the proxy names it: "URL,BOOTSTRAP_URL"."""
        return [f"{p.url},{p.bootstrap_url}" for p in self.of("prefill")]

    @property
    def decode_backends(self) -> list[str]:
        return [d.url for d in self.of("decode")]

    def proxy_args(self) -> list[str]:
        """The proxy's policy and backends, as its command line names them (a proxy started
        by hand for the cluster; pdctl writes them into its config file)."""
        args = ["--policy", self.policy] if self.policy else []
        for url in self.prefill_backends:
            args += ["--prefill", url]
        for url in self.decode_backends:
            args += ["--decode", url]
        return args


def host_plan(cfg: HostConfig) -> ClusterPlan:
    """What one cluster host runs (its config's [cluster] part), as the cluster plan names
    it: `pdctl status` there reports on these."""
    assert cfg.cluster is not None
    proxy = (f"http://{host_port(cfg.host.ip, cfg.ports.proxy)}" if cfg.cluster.proxy
             else None)
    return ClusterPlan(tuple(_instances(cfg.host.name, cfg.host.ip, cfg.ports,
                                        cfg.cluster.prefill, cfg.cluster.decode)),
                       proxy, cfg.host.name, cfg.proxy.policy)


def load_cluster(path: Path) -> ClusterDescription:
    return load_validated(ClusterDescription, path, "no such cluster description")


def parse_cluster(data: dict[str, Any]) -> ClusterDescription:
    """Validate a cluster description; ConfigError lists every problem, one per line."""
    return validated(ClusterDescription, data)
