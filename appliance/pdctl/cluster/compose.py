"""compose.yaml for a cluster host: the 1P1D file's services, as many as this host runs.

A cluster host runs any number of P and D instances (and the proxy when the description
puts it here). P instance i is the 1P1D file's `prefill` service as `prefill-<i>` beside its
own sidecar `bootstrap-<i>` (a sidecar holds one engine per dp rank, as vLLM's bootstrap
server does); D instance i is `decode` as `decode-<i>`. Their own values are renamed in
every string (`${PD_PREFILL_PORT` becomes `${PD_PREFILL_1_PORT`, ...) and written per
instance into `.env`. Deriving the services from compose.yaml (and compose.cpu.yaml) keeps
one definition of how P and D start; a 1P1D node still gets those files verbatim.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from appliance.pdctl.config.hostconfig import HostConfig, engine_id

ROLES = ("prefill", "decode")
# The values that differ between two instances of a role on one host.
PER_INSTANCE = ("PORT", "GPUS", "CPUS", "ENGINE_ID", "RDMA_DEVICE")


def _service(role: str, n: int) -> str:
    return f"{role}-{n}"


def service_names(cfg: HostConfig) -> tuple[str, ...]:
    """The compose services this host runs, in start order."""
    return tuple(cfg.service_ports())


def instance_env(cfg: HostConfig) -> dict[str, str]:
    """Each instance's own values: its port (a P's sidecar's too), devices and engine id."""
    out = {}
    for role in ROLES:
        for n, devices in enumerate(cfg.instances(role)):
            key = f"PD_{role.upper()}_{n}"
            listed = ",".join(map(str, devices))
            out[f"{key}_PORT"] = str(cfg.ports.of(role, n))
            # Both set, as for a 1P1D node: compose interpolates the GPU reservation before
            # the CPU override resets it.
            out[f"{key}_GPUS"] = out[f"{key}_CPUS"] = listed
            out[f"{key}_ENGINE_ID"] = engine_id(cfg.host.name, role, n)
            # The role's NICs, the same for each instance: Mooncake takes, for each GPU
            # buffer, the nearest of those listed.
            out[f"{key}_RDMA_DEVICE"] = cfg.transfer.device_name(role)
            if role == "prefill":
                out[f"PD_BOOTSTRAP_{n}_PORT"] = str(cfg.ports.of("bootstrap", n))
    return out


def _renamed(value: Any, n: int, *prefixes: str) -> Any:
    """`value` with the per-instance variables of `prefixes` renamed to instance n's."""
    if isinstance(value, str):
        pattern = rf"\$\{{PD_({'|'.join(prefixes)})_({'|'.join(PER_INSTANCE)})\b"
        return re.sub(pattern, lambda m: f"${{PD_{m.group(1)}_{n}_{m.group(2)}", value)
    if isinstance(value, list):
        return [_renamed(v, n, *prefixes) for v in value]
    if isinstance(value, dict):
        return {k: _renamed(v, n, *prefixes) for k, v in value.items()}
    return value


# Whose values each instance's services carry: a P names its own sidecar's port.
_PREFIXES = {"bootstrap": ("BOOTSTRAP",), "prefill": ("PREFILL", "BOOTSTRAP"),
             "decode": ("DECODE",)}


def _instances(cfg: HostConfig, services: dict[str, Any]) -> dict[str, Any]:
    """Each of the host's instances from its role's service, a P's sidecar first."""
    out = {}
    for name in service_names(cfg):
        role, _, n = name.partition("-")
        if n and role in services:
            svc = _renamed(copy.deepcopy(services[role]), int(n), *_PREFIXES[role])
            if "depends_on" in svc:  # P waits for its own sidecar; D for nothing here
                svc["depends_on"] = {_service(dep, int(n)): cond
                                     for dep, cond in svc["depends_on"].items()
                                     if role == "prefill"}
                if not svc["depends_on"]:
                    del svc["depends_on"]
            out[name] = svc
    return out


def host_compose(cfg: HostConfig, base_text: str) -> str:
    """The host's compose.yaml from the 1P1D one."""
    base = yaml.safe_load(base_text)  # anchors and `<<:` merges resolved
    out = _instances(cfg, base["services"])
    if cfg.cluster is not None and cfg.cluster.proxy:
        proxy = copy.deepcopy(base["services"]["proxy"])
        # Only what runs here can be waited for; the proxy's /health tells the rest.
        proxy.pop("depends_on", None)
        if out:
            proxy["depends_on"] = {name: {"condition": "service_healthy"} for name in out}
        out["proxy"] = proxy
    source = cfg.cluster.cluster if cfg.cluster else ""
    head = (f"# {cfg.host.name}: its part of the cluster {source}\n# Written by `pdctl "
            f"render` from compose.yaml's services (one per instance); values in .env.\n")
    doc = {"name": base["name"], "services": out}
    if base.get("volumes"):  # the compile cache every vLLM service mounts
        doc["volumes"] = base["volumes"]
    return head + yaml.safe_dump(doc, sort_keys=False, width=100)


class _Reset:
    """Compose's `!reset` tag, kept through a load and a dump."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


def _construct_reset(loader: yaml.SafeLoader, node: yaml.Node) -> _Reset:
    if isinstance(node, yaml.MappingNode):
        return _Reset(loader.construct_mapping(node))
    if isinstance(node, yaml.SequenceNode):
        return _Reset(loader.construct_sequence(node))
    return _Reset(loader.construct_scalar(node))  # type: ignore[arg-type]


def _represent_reset(dumper: yaml.SafeDumper, data: _Reset) -> yaml.Node:
    if isinstance(data.value, dict):
        return dumper.represent_mapping("!reset", data.value)
    if isinstance(data.value, list):
        return dumper.represent_sequence("!reset", data.value)
    return dumper.represent_scalar("!reset", str(data.value))


_Loader.add_constructor("!reset", _construct_reset)
_Dumper.add_representer(_Reset, _represent_reset)


def host_override(cfg: HostConfig, override_text: str) -> str:
    """The CPU override (compose.cpu.yaml) for the host's instances."""
    services = yaml.load(override_text, Loader=_Loader)["services"]  # noqa: S506 - SafeLoader
    doc = {"services": _instances(cfg, services)}
    return ("# Written by `pdctl render` from compose.cpu.yaml: the CPU stack's differences, "
            "per instance.\n" + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100))
