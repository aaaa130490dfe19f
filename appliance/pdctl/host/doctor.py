"""Host preflight: every check says pass, fail, warn or skip, and on failure or warning how
to fix it (`verdict.Check`; a warning does not fail `pdctl doctor`).

On the CPU stack the GPU, RDMA, memlock and NVIDIA runtime checks are skipped and the CPUs
P and D are pinned to are checked instead."""

from __future__ import annotations

import ipaddress

from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.config.sections import PortsSection
from appliance.pdctl.host.composebin import MIN_COMPOSE, version_tuple
from appliance.pdctl.host.pcichecks import check_acs, check_nic_placement
from appliance.pdctl.host.probe import UNLIMITED, HostProbe, Memlock, RdmaDevice
from appliance.pdctl.host.verdict import Check, failed, passed, skipped, warned


def check_exposure(cfg: HostConfig | None) -> list[Check]:
    """What would face a network it should not: the internal address, wildcard binds."""
    if cfg is None:
        return []
    out = []
    ip = ipaddress.ip_address(cfg.host.ip)
    if ip.is_global:
        out.append(warned("internal address", f"host.ip {ip} is a public address: P, D, the "
                         "bootstrap sidecar, the side channels and Mooncake (whose ports read "
                         "and write this host's memory) would listen on it",
                         "set host.ip to the cluster network's address (a private one) and "
                         "firewall the rest (README, Security)"))
    else:
        out.append(passed("internal address", f"host.ip {ip} is not public"))
    first, last = cfg.transfer.port_range
    out.append(warned("mooncake ports", f"Mooncake listens on every address on ports "
                     f"{first}-{last} (it cannot be bound to host.ip)",
                     f"firewall ports {first}-{last} to the cluster network, e.g. nft add rule "
                     f"inet filter input tcp dport {first}-{last} ip saddr != <cluster CIDR> "
                     "drop"))
    if ipaddress.ip_address(cfg.compose.bind).is_unspecified:
        out.append(warned("proxy bind", f"the proxy listens on every address "
                         f"({cfg.compose.bind}:{cfg.ports.proxy})",
                         "set compose.bind to the client-facing address if the host has "
                         "others"))
    return out


def _ranges(values: list[int]) -> str:
    return ", ".join(map(str, values)) or "none"


# What compose.yaml needs: Engine 20.10 (API 1.41) for every key it uses (Compose's
# minimum is appliance.pdctl.host.composebin's).
MIN_ENGINE = (20, 10)


def _dotted(version: tuple[int, ...], width: int = 1) -> str:
    return ".".join(f"{v:0{width}d}" if i else str(v) for i, v in enumerate(version))


# The GPU images run CUDA 13.0 (torch cu130): NVIDIA's driver for CUDA 13.x is branch 580
# or later (CUDA Compatibility, minor version compatibility table), 580.65.06 being the
# driver CUDA 13.0 GA shipped with (CUDA 13.0 release notes).
MIN_DRIVER = (580, 65, 6)


def check_driver(probe: HostProbe) -> Check:
    name = "NVIDIA driver"
    version, source = probe.driver_release()
    if version is None:
        return skipped(name, "version unknown (nvidia-smi, /proc/driver/nvidia/version)")
    if version_tuple(version) < MIN_DRIVER:
        return failed(name, f"{version} (from {source}): the images' CUDA 13.0 needs "
                     f"{_dotted(MIN_DRIVER, 2)} or later",
                     "install a driver of branch 580 or later, e.g. Ubuntu's "
                     "nvidia-driver-580-server-open (or nvidia-driver-580), or "
                     "cuda-drivers-580 from NVIDIA's CUDA repository; then reboot")
    return passed(name, f"{version} (from {source}; CUDA 13.0 needs {_dotted(MIN_DRIVER, 2)})")


def check_gpus(cfg: HostConfig | None, probe: HostProbe) -> list[Check]:
    if cfg is not None and cfg.stack == "cpu":
        return [skipped("GPUs", "stack is cpu"), skipped("NVIDIA driver", "stack is cpu"),
                check_cpus(cfg, probe)]
    gpus, source = probe.gpus()
    if not gpus:
        return [failed("GPUs", "no NVIDIA GPU found (nvidia-smi, /proc/driver/nvidia/gpus)",
                      "install the NVIDIA driver; `nvidia-smi` must list the GPUs"),
                skipped("GPU indices", "no GPUs")]
    names = sorted({g.name for g in gpus})
    out = [passed("GPUs", f"{len(gpus)} × {' / '.join(names)} (from {source})"),
           check_driver(probe)]
    if cfg is None:
        return out + [skipped("GPU indices", "no host config")]
    have = {g.index for g in gpus}
    missing = [f"GPU {i} ({where})" for where, devices in cfg.device_fields()
               for i in devices if i not in have]
    if missing:
        out.append(failed("GPU indices", f"{', '.join(missing)} does not exist; this host has "
                         f"GPUs {_ranges(sorted(have))}",
                         "set gpus.prefill and gpus.decode to indices nvidia-smi lists"))
    else:
        out.append(passed("GPU indices", _instances(cfg)))
    return out


def check_cpus(cfg: HostConfig, probe: HostProbe) -> Check:
    online = probe.cpus()
    missing = [f"CPU {c} ({where})" for where, devices in cfg.device_fields()
               for c in devices if c not in online]
    if missing:
        return failed("CPUs", f"{', '.join(missing)} not online; online: {_ranges(online)}",
                     "set cpus.prefill and cpus.decode to CPUs of this host, P and D apart")
    return passed("CPUs", f"{_instances(cfg)} ({len(online)} online)")


def _instances(cfg: HostConfig) -> str:
    """"prefill 0, decode 1" for a 1P1D node; every instance's devices on a cluster host."""
    parts = []
    for role in ("prefill", "decode"):
        lists = [_ranges(d) for d in cfg.instances(role)]
        if lists:
            parts.append(f"{role} {' / '.join(lists)}")
    return ", ".join(parts)


def _configured_nics(cfg: HostConfig | None) -> list[str]:
    """Every RDMA device the config lists, P's first, once each."""
    if cfg is None:
        return []
    names = cfg.transfer.devices("prefill") + cfg.transfer.devices("decode")
    return list(dict.fromkeys(names))


def check_rdma(cfg: HostConfig | None, probe: HostProbe) -> list[Check]:
    names = ("RDMA device", "RDMA port", "/dev/infiniband", "GPUDirect RDMA")
    if cfg is not None and cfg.transfer.protocol == "tcp":
        return [skipped(n, "transfer.protocol is tcp") for n in names]
    devices = probe.rdma_devices()
    byname = {d.name: d for d in devices}
    out: list[Check] = []
    wanted = _configured_nics(cfg)
    chosen: list[RdmaDevice] = []
    if not devices:
        out.append(failed("RDMA device", "no RDMA device in /sys/class/infiniband",
                         "install the NIC driver and rdma-core (mlx5_core, mlx5_ib), or set "
                         "transfer.protocol = \"tcp\""))
    elif wanted:
        chosen = [byname[w] for w in wanted if w in byname]
        missing = [w for w in wanted if w not in byname]
        if missing:
            out.append(failed("RDMA device", f"{', '.join(missing)} not found (this host has: "
                             f"{', '.join(d.name for d in devices)})",
                             "list this host's devices in transfer.prefill_devices and "
                             "decode_devices (or transfer.device); `ibv_devinfo -l` lists "
                             "them, `pdctl init` picks the nearest"))
        else:
            out.append(passed("RDMA device", "; ".join(_describe_device(d) for d in chosen)))
    else:
        chosen = [next((d for d in devices if d.active_ports), devices[0])]
        out.append(passed("RDMA device", f"{_describe_device(chosen[0])} (no transfer.device "
                         f"configured; first with an ACTIVE port)"))
    if not chosen or len(chosen) < len(wanted):
        out.append(skipped("RDMA port", "no RDMA device" if not chosen else
                         "a configured device is missing"))
    elif all(d.active_ports for d in chosen):
        out.append(passed("RDMA port", "; ".join(
            f"{d.name} port {d.active_ports[0].number} ACTIVE, "
            f"{d.active_ports[0].rate or 'rate unknown'}" for d in chosen)))
    else:
        down = [d for d in chosen if not d.active_ports]
        states = "; ".join(f"{d.name}: " + (", ".join(f"port {p.number} {p.state}"
                                                     for p in d.ports) or "no ports")
                           for d in down)
        out.append(failed("RDMA port", states,
                         f"check the cable, the switch and (InfiniBand) the subnet manager; "
                         f"`ibstat {down[0].name}` shows the link"))
    nodes = probe.infiniband_dev_nodes()
    if any(n.startswith("uverbs") for n in nodes):
        out.append(passed("/dev/infiniband", ", ".join(nodes)))
    else:
        out.append(failed("/dev/infiniband", "missing" if not nodes else
                         f"no uverbs device ({', '.join(nodes)})",
                         "modprobe ib_uverbs rdma_ucm (the verbs device nodes come from them)"))
    out.append(check_gpudirect(cfg, probe))
    return out


def _describe_device(dev: RdmaDevice) -> str:
    layer = next((p.link_layer for p in dev.ports if p.link_layer), "")
    extra = [x for x in (layer, ", ".join(dev.netdevs)) if x]
    return f"{dev.name}" + (f" ({'; '.join(extra)})" if extra else "")


def check_gpudirect(cfg: HostConfig | None, probe: HostProbe) -> Check:
    name = "GPUDirect RDMA"
    mode = cfg.transfer.gpudirect if cfg is not None else "auto"
    peermem = probe.peermem_loaded()
    dmabuf, why = probe.dmabuf_usable()
    if mode in ("auto", "peermem") and peermem:
        return passed(name, "nvidia_peermem loaded")
    if mode in ("auto", "dmabuf") and dmabuf:
        return passed(name, f"DMA-BUF usable ({why})")
    if mode == "dmabuf":
        return failed(name, f"DMA-BUF not usable: {why}",
                     "install the NVIDIA open kernel modules (driver >= 515, Linux >= 5.12), or "
                     "set transfer.gpudirect = \"peermem\" and load nvidia_peermem")
    alt = " or set transfer.gpudirect = \"dmabuf\" (usable here)" if dmabuf else \
        f" or, for DMA-BUF, NVIDIA's open kernel modules ({why})" if mode == "auto" else ""
    return failed(name, "nvidia_peermem is not loaded: memory registration would fail with "
                 "\"Bad address\"",
                 "modprobe nvidia_peermem, and keep it across reboots with "
                 "/etc/modules-load.d/nvidia-peermem.conf (install.sh --gpu --systemd writes "
                 f"it){alt}")


def check_memlock(cfg: HostConfig | None, probe: HostProbe) -> Check:
    """What the engines get: the compose services ask for unlimited memlock (and IPC_LOCK),
    which dockerd grants if it may raise a hard limit. pdctl's own limit does not matter:
    it starts no engine that pins memory (`up --local` is the CPU build over TCP), and
    under systemd it is the unit's, not limits.conf's."""
    name = "memlock"
    if cfg is not None and cfg.transfer.protocol == "tcp":
        return skipped(name, "transfer.protocol is tcp (nothing is pinned for RDMA)")
    daemon = probe.dockerd()
    if daemon is None:
        return skipped(name, "no dockerd running (/var/run/docker.pid, /proc): the compose "
                     "services ask it for unlimited memlock")
    asked = "the compose services ask for unlimited memlock (ulimits, IPC_LOCK)"
    if daemon.can_raise_limits:
        return passed(name, f"{asked}; dockerd (pid {daemon.pid}) runs as root and grants it")
    hard = daemon.memlock.hard if daemon.memlock is not None else None
    who = f"dockerd (pid {daemon.pid}, uid {daemon.uid if daemon.uid is not None else '?'})"
    if hard == UNLIMITED:
        return passed(name, f"{asked}; rootless {who} has an unlimited hard memlock")
    have = "unknown" if hard is None else Memlock.describe(hard)
    return failed(name, f"{asked}, but rootless {who} cannot raise its hard memlock "
                 f"({have}) for them: RDMA cannot pin the KV cache",
                 "give the rootless daemon LimitMEMLOCK=infinity (systemctl --user edit "
                 "docker: [Service] LimitMEMLOCK=infinity; the user's hard limit too: "
                 "`<user> hard memlock unlimited` in /etc/security/limits.conf), then "
                 "systemctl --user restart docker; or use the rootful engine")


def check_ports(cfg: HostConfig | None, probe: HostProbe) -> Check:
    name = "ports"
    ports = cfg.service_ports() if cfg is not None else PortsSection().model_dump()
    listening = probe.listening_ports()
    if listening is None:
        return skipped(name, "cannot read /proc/net/tcp")
    busy = [f"{port} ({role})" for role, port in ports.items() if port in listening]
    if busy:
        return failed(name, f"in use: {', '.join(busy)}",
                     "stop what listens there (`ss -ltnp` shows it; `pdctl down` if it is a "
                     "running node) or change [ports] in the host config")
    return passed(name, "free: " + ", ".join(f"{p} ({r})" for r, p in ports.items()))


def check_docker(probe: HostProbe, stack: str = "gpu") -> list[Check]:
    version, why = probe.docker_server_version()
    if version is None:
        if "not found" in why:
            fix = "install Docker Engine (Debian: apt-get install docker.io)"
            return [failed("docker", why, fix), skipped("docker compose", "no docker CLI"),
                    skipped("NVIDIA container runtime", "no docker CLI")]
        daemon = failed("docker", f"daemon not reachable: {why}",
                       "systemctl start docker (and add this user to the docker group)")
    elif version_tuple(version) < MIN_ENGINE:
        daemon = failed("docker", f"Engine {version}: compose.yaml needs Engine "
                       f"{_dotted(MIN_ENGINE)} or later", "upgrade Docker Engine (docker-ce)")
    else:
        daemon = passed("docker", f"Engine {version}")
    out = [daemon]
    compose, why = probe.compose()
    if compose is None:
        out.append(failed("docker compose", why,
                         "re-run install.sh (it installs the bundled Compose v2) or install "
                         "the Compose v2 plugin (docker-compose-plugin)"))
    elif version_tuple(compose.version) < MIN_COMPOSE:
        out.append(failed("docker compose", f"{compose.describe()}: the node's compose files "
                         f"need Compose {_dotted(MIN_COMPOSE)} or later",
                         "re-run install.sh (it installs the bundled Compose v2) or upgrade "
                         "the Compose v2 plugin (docker-compose-plugin)"))
    else:
        out.append(passed("docker compose", compose.describe()))
    if stack == "cpu":
        out.append(skipped("NVIDIA container runtime", "stack is cpu"))
        return out
    if version is None:
        out.append(skipped("NVIDIA container runtime", "docker daemon not reachable"))
        return out
    runtimes, why = probe.docker_runtimes()
    if runtimes is None:
        out.append(failed("NVIDIA container runtime", why, "check `docker info`"))
    elif "nvidia" in runtimes:
        out.append(passed("NVIDIA container runtime", f"runtimes: {', '.join(runtimes)}"))
    else:
        out.append(failed("NVIDIA container runtime", f"not registered (runtimes: "
                         f"{', '.join(runtimes) or 'none'})",
                         "install nvidia-container-toolkit, then `nvidia-ctk runtime configure "
                         "--runtime=docker && systemctl restart docker`"))
    return out


def check_model(cfg: HostConfig | None, probe: HostProbe) -> Check:
    if cfg is None:
        return skipped("model", "no host config")
    path = probe.path(cfg.model.path)
    if not path.is_dir():
        return failed("model", f"{cfg.model.path} does not exist",
                     f"download it there, e.g. `huggingface-cli download <repo> --local-dir "
                     f"{cfg.model.path}`")
    if not (path / "config.json").is_file():
        return failed("model", f"{cfg.model.path} has no config.json",
                     "point model.path at a Hugging Face model directory")
    return passed("model", cfg.model.path)


def run_checks(cfg: HostConfig | None, probe: HostProbe) -> list[Check]:
    return [*check_gpus(cfg, probe), *check_rdma(cfg, probe), *check_nic_placement(cfg, probe),
            check_acs(cfg, probe), check_memlock(cfg, probe), check_ports(cfg, probe),
            check_model(cfg, probe), *check_exposure(cfg),
            *check_docker(probe, cfg.stack if cfg is not None else "gpu")]
