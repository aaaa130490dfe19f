"""`pdctl init`: detect this host's GPUs (or CPUs), RDMA devices and address, and write its
config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from appliance import keys
from appliance.pdctl.clibase import config_option, config_path_of, env_of
from appliance.pdctl.cluster.description import ROLES
from appliance.pdctl.config import hostconfig as cfgmod
from appliance.pdctl.config.hostconfig import parse_config
from appliance.pdctl.config.toml import to_toml
from appliance.pdctl.errors import USAGE, ConfigError, PdctlError
from appliance.pdctl.host.check import host_problems
from appliance.pdctl.host.probe import Gpu, HostProbe, RdmaDevice, split_cpus
from appliance.pdctl.host.topology import GpuSite, assign_nics, role_devices
from appliance.pdctl.node.render import keys_dir


def _ints(value: str | None, what: str = "GPU") -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of {what} indices") \
            from None


@click.command()
@click.option("--out", "out_path", type=click.Path(path_type=Path, dir_okay=False),
              help="where to write the config (default: --config, $PDCTL_CONFIG or "
                   f"{cfgmod.DEFAULT_CONFIG})")
@config_option
@click.option("--model", "model_path", help="model directory on this host (absolute path)")
@click.option("--served-name", help="model name clients use (default: the directory's name)")
@click.option("--name", "host_name", help="host name (default: hostname)")
@click.option("--host-ip", help="address peers reach this host at (default: detected)")
@click.option("--stack", type=click.Choice(["gpu", "cpu"]),
              help="the serving stack (default: gpu when this host has NVIDIA GPUs, else cpu)")
@click.option("--prefill-gpus", help="GPU indices for P, e.g. 0 or 0,1 (default: first tp_size)")
@click.option("--decode-gpus", help="GPU indices for D (default: the next tp_size)")
@click.option("--prefill-cpus", help="stack cpu: CPUs for P, e.g. 0,1 (default: the first half)")
@click.option("--decode-cpus", help="stack cpu: CPUs for D (default: the second half)")
@click.option("--max-model-len", type=click.IntRange(16), help="longest request in tokens "
              "(default: the model's own)")
@click.option("--kv-cache-bytes", type=click.IntRange(1 << 20), help="stack cpu: KV cache "
              "per server (default: sized from the model and max-model-len)")
@click.option("--tp-size", type=click.IntRange(1, 16), default=1, show_default=True)
@click.option("--prefill-tp-size", type=click.IntRange(1, 16),
              help="P's TP size when it differs from D's (default: --tp-size)")
@click.option("--decode-tp-size", type=click.IntRange(1, 16),
              help="D's TP size when it differs from P's (default: --tp-size)")
@click.option("--protocol", type=click.Choice(["rdma", "tcp"]),
              help="KV transport (default: rdma when an RDMA port is ACTIVE, else tcp)")
@click.option("--rdma-device", help="one RDMA device for P and D (default: each role's NICs "
              "nearest its GPUs, from the PCIe tree)")
@click.option("--gpudirect", type=click.Choice(["auto", "peermem", "dmabuf"]), default="auto",
              show_default=True, help="GPUDirect path: auto lets each container's preflight "
              "take the one it finds usable (nvidia_peermem, else DMA-BUF)")
@click.option("--proxy-port", type=click.IntRange(1, 65535), help="default 8000")
@click.option("--prefill-port", type=click.IntRange(1, 65535), help="default 8010")
@click.option("--decode-port", type=click.IntRange(1, 65535), help="default 8020")
@click.option("--bootstrap-port", type=click.IntRange(1, 65535), help="default 8998")
@click.option("--rotate-keys", is_flag=True,
              help="write new node keys (keys/ beside the config) and change nothing else; "
                   "then `pdctl up` restarts the node with them")
@click.option("--force", is_flag=True, help="overwrite an existing config")
@click.option("--no-input", is_flag=True, help="never prompt (the default when flags are given)")
@click.pass_context
def init(ctx: click.Context, out_path: Path | None, config_path: Path | None,
         model_path: str | None, served_name: str | None, host_name: str | None,
         host_ip: str | None, stack: str | None, prefill_gpus: str | None,
         decode_gpus: str | None, prefill_cpus: str | None, decode_cpus: str | None,
         max_model_len: int | None, kv_cache_bytes: int | None, tp_size: int,
         prefill_tp_size: int | None, decode_tp_size: int | None, protocol: str | None,
         rdma_device: str | None, gpudirect: str,
         proxy_port: int | None, prefill_port: int | None, decode_port: int | None,
         bootstrap_port: int | None, rotate_keys: bool, force: bool, no_input: bool) -> None:
    """Detect this host's GPUs (or CPUs), RDMA devices and address, and write its config
    and the node's keys."""
    env = env_of(ctx)
    probe = env.probe
    out = env.out
    target = out_path or config_path_of(config_path)
    if rotate_keys:
        if not target.exists():
            raise PdctlError(f"no config at {target} to rotate the keys of (run pdctl init "
                             "first)", USAGE)
        written = _write_keys(target, rotate=True)
        out.print(f"pdctl: wrote new keys to {written.dir} (api key, bootstrap token, side-"
                  "channel key); `pdctl up` restarts the node with them; copy them to every "
                  "host of the cluster")
        return
    if target.exists() and not force:
        raise PdctlError(f"{target} exists (use --force to overwrite it)", USAGE)

    gpus, source = probe.gpus()
    devices = probe.rdma_devices()
    active = [d for d in devices if d.active_ports]
    out.print(f"GPUs: {len(gpus)}" + (f" ({', '.join(f'{g.index}: {g.name}' for g in gpus)}; "
                                      f"from {source})" if gpus else ""))
    for d in devices:
        ports = ", ".join(f"port {p.number} {p.state} {p.rate}".strip() for p in d.ports)
        out.print(f"RDMA: {d.name} ({ports or 'no ports'})")
    if not devices:
        out.print("RDMA: no devices in /sys/class/infiniband")

    interactive = not no_input and sys.stdin.isatty() and model_path is None
    if model_path is None:
        if not interactive:
            raise PdctlError("--model is required (the model directory on this host)", USAGE)
        model_path = click.prompt("model directory on this host")
    stack = stack or ("gpu" if gpus else "cpu")
    if protocol is None:
        protocol = "rdma" if stack == "gpu" and (rdma_device or active) else "tcp"
    model: dict[str, Any] = {"path": model_path, "tp_size": tp_size}
    for key, value in (("served_name", served_name), ("max_model_len", max_model_len),
                       ("kv_cache_bytes", kv_cache_bytes), ("prefill_tp_size", prefill_tp_size),
                       ("decode_tp_size", decode_tp_size)):
        if value is not None:
            model[key] = value
    data: dict[str, Any] = {"stack": stack, "model": model}
    ports = {name: port for name, port in (("proxy", proxy_port), ("prefill", prefill_port),
                                           ("decode", decode_port),
                                           ("bootstrap", bootstrap_port)) if port is not None}
    if ports:
        data["ports"] = ports
    if stack == "gpu":
        p = _ints(prefill_gpus) or list(range(prefill_tp_size or tp_size))
        d = _ints(decode_gpus) or list(range(len(p), len(p) + (decode_tp_size or tp_size)))
        data["gpus"] = {"prefill": p, "decode": d}
        placed = f"P GPUs {p}, D GPUs {d}"
    else:
        online = probe.cpus()
        half_p, half_d = split_cpus(online, most=len(online))
        p = _ints(prefill_cpus, "CPU") or list(half_p or ())
        d = _ints(decode_cpus, "CPU") or list(half_d or ())
        if not p or not d:
            raise PdctlError(f"stack cpu needs two CPUs at least (this host has "
                             f"{len(online)}), or --prefill-cpus and --decode-cpus", USAGE)
        data["cpus"] = {"prefill": p, "decode": d}
        placed = f"stack cpu, P CPUs {p}, D CPUs {d}"
    transfer: dict[str, Any] = {"protocol": protocol, "gpudirect": gpudirect}
    nics: list[RdmaDevice] = []
    if protocol == "rdma":
        nics = _choose_nics(transfer, probe, gpus, devices, rdma_device,
                            (p, d) if stack == "gpu" else None, out)
    data["transfer"] = transfer
    why = "--host-ip"
    if host_ip is None:
        host_ip, why = _host_address(probe, nics)
        if host_ip is None:
            raise PdctlError("could not detect this host's address; pass --host-ip", USAGE)
    data["host"] = {"ip": host_ip, **({"name": host_name} if host_name else {})}
    cfg = parse_config(data)
    problems = host_problems(cfg, probe)
    fatal = [p for p in problems if not p.startswith(("model.path", "auth."))]
    if fatal:
        raise ConfigError(fatal)
    for warning in problems:
        if warning not in fatal:
            out.print(f"pdctl: warning: {warning}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(to_toml(cfg))
    except OSError as exc:
        raise PdctlError(f"cannot write {target}: {exc.strerror or exc}") from None
    written = _write_keys(target, rotate=False)
    via = ""
    if protocol == "rdma":
        p_nics, d_nics = cfg.transfer.device_name("prefill"), cfg.transfer.device_name("decode")
        via = f" via {p_nics}" if p_nics == d_nics else f" via P {p_nics}, D {d_nics}"
    out.print(f"pdctl: wrote {target} ({placed}, {protocol}{via}, host {host_ip}) and the "
              f"node's keys in {written.dir}")
    kv = "Mooncake's handshake goes to host.ip, the KV over RDMA by each NIC's GID" \
        if protocol == "rdma" else "the KV goes over Mooncake's TCP transport to host.ip"
    out.print(f"addresses: host.ip {host_ip} ({why}) serves P, D, the bootstrap sidecar and the "
              f"side channels; the proxy listens on compose.bind ({cfg.compose.bind}:"
              f"{cfg.ports.proxy}); {kv}")
    out.print("next: pdctl doctor, then pdctl up")


def _choose_nics(transfer: dict[str, Any], probe: HostProbe, gpus: list[Gpu],
                 devices: list[RdmaDevice], pinned: str | None,
                 roles: tuple[list[int], list[int]] | None, out: Console) -> list[RdmaDevice]:
    """Fill transfer's devices: --rdma-device for both roles, else per role the NIC nearest
    each of its GPUs (stack cpu: the first ACTIVE one). Returns the chosen devices."""
    byname = {dev.name: dev for dev in devices}
    if pinned:
        transfer["device"] = pinned
        out.print(f"RDMA: {pinned} for P and D (--rdma-device)")
        return [byname[pinned]] if pinned in byname else []
    if roles is None:
        first = next((dev for dev in devices if dev.active_ports), None)
        transfer["device"] = first.name if first else ""
        return [first] if first else []
    sites = {s.index: s for s in probe.gpu_sites(gpus)}
    choices = assign_nics({role: [sites.get(i, GpuSite(i, None)) for i in indices]
                           for role, indices in zip(ROLES, roles, strict=True)},
                          [dev.as_nic() for dev in devices])
    chosen: list[RdmaDevice] = []
    for role in ROLES:
        names = role_devices(choices, role)
        transfer[f"{role}_devices"] = names
        chosen += [byname[n] for n in names if byname[n] not in chosen]
        pairs = ", ".join(f"GPU {c.gpu} → {c.nic} ({c.distance.name}: {c.distance.meaning})"
                          for c in choices if c.role == role)
        if pairs:
            out.print(f"RDMA for {role}: {pairs}")
    return chosen


def _host_address(probe: HostProbe, nics: list[RdmaDevice]) -> tuple[str | None, str]:
    """RoCE: the NIC's netdev address is an ordinary Ethernet address. InfiniBand: its
    netdev is IPoIB, which clients, the proxy and an Ethernet-only peer may not reach, so
    the primary address; KV moves by the NIC's GID either way."""
    ib = [n for n in nics if n.link_layer == "InfiniBand"]
    if nics and not ib:
        return probe.host_ip(tuple(dev for n in nics for dev in n.netdevs))
    ip, why = probe.host_ip()
    return ip, why + (f"; not {ib[0].name}'s IPoIB netdev" if ib else "")


def _write_keys(config: Path, rotate: bool) -> keys.NodeKeys:
    try:
        return keys.ensure(keys_dir(config.parent.resolve()), rotate=rotate)
    except OSError as exc:
        raise PdctlError(f"cannot write the node's keys: {exc.strerror or exc}") from None
