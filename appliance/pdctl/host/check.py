"""Config problems only this host can show: missing GPUs or CPUs, RDMA devices, model
files, key files. One line each, `<field>: <what is wrong>`, like the file's own problems."""

from __future__ import annotations

from pathlib import Path

from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.host.probe import HostProbe
from appliance.pdctl.host.topology import natural_key


def host_problems(cfg: HostConfig, probe: HostProbe) -> list[str]:
    """Problems that only this host can show: missing GPUs, devices, files."""
    out = _gpu_host_problems(cfg, probe) if cfg.stack == "gpu" else _cpu_host_problems(cfg, probe)
    model_dir = probe.path(cfg.model.path)
    if not model_dir.is_dir():
        out.append(f"model.path: {cfg.model.path} does not exist on this host (download the "
                   f"model there first)")
    elif not (model_dir / "config.json").is_file():
        out.append(f"model.path: {cfg.model.path} has no config.json (not a model directory)")
    for key in ("api_keys_file", "bootstrap_token_file"):
        value = getattr(cfg.auth, key)
        if value and not _nonempty(Path(value)):  # pdctl's own files: not under the root
            out.append(f"auth.{key}: {value} is missing or empty")
    return out


def _gpu_host_problems(cfg: HostConfig, probe: HostProbe) -> list[str]:
    out = []
    gpus, _source = probe.gpus()
    if not gpus:
        out.append("gpus: no NVIDIA GPU found on this host (nvidia-smi, /proc/driver/nvidia); "
                   "on a CPU host set stack = \"cpu\" (`pdctl init --stack cpu`)")
    else:
        have = {g.index for g in gpus}
        found = ", ".join(str(i) for i in sorted(have))
        for where, devices in cfg.device_fields():
            for idx in devices:
                if idx not in have:
                    out.append(f"{where}: GPU {idx} does not exist on this host "
                               f"(GPUs: {found})")
    if cfg.transfer.protocol == "rdma":
        have = {d.name for d in probe.rdma_devices()}
        known = ", ".join(sorted(have, key=natural_key)) or "none in /sys/class/infiniband"
        for where, names in cfg.transfer.listed().items():
            for name in names:
                if name not in have:
                    out.append(f"transfer.{where}: unknown RDMA device {name!r} (this host "
                               f"has: {known})")
    return out


def _cpu_host_problems(cfg: HostConfig, probe: HostProbe) -> list[str]:
    have = set(probe.cpus())
    out = []
    for where, devices in cfg.device_fields():
        missing = [c for c in devices if c not in have]
        if missing:
            out.append(f"{where}: CPU {missing[0]} is not online on this host (online: "
                       f"{', '.join(map(str, sorted(have)))})")
    return out


def _nonempty(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False
