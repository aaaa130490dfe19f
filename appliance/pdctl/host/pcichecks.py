"""Doctor's PCIe checks: how far each role's NICs are from its GPUs, and whether ACS sends
the GPU-NIC peer-to-peer traffic up to the root complex."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.pdctl.cluster.description import ROLES
from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.host.probe import HostProbe
from appliance.pdctl.host.topology import (
    Distance,
    GpuSite,
    Nic,
    acs_flags,
    acs_redirects,
    nearest,
    p2p_bridges,
)
from appliance.pdctl.host.verdict import Check, passed, skipped, warned


@dataclass(frozen=True)
class Pair:
    role: str
    gpu: GpuSite
    nic: Nic
    distance: Distance


def _pairs(cfg: HostConfig | None, probe: HostProbe) -> list[Pair]:
    """Each role's GPU and the NIC Mooncake takes for its buffers (the nearest of the
    role's list); without a config every GPU and its nearest ACTIVE NIC."""
    gpus, _source = probe.gpus()
    sites = {s.index: s for s in probe.gpu_sites(gpus)}
    devices = {d.name: d.as_nic() for d in probe.rdma_devices()}
    if cfg is None:
        lists = {"": [n for n in devices.values() if n.active]}
        role_gpus = {"": sorted(sites)}
    else:
        lists = {r: [devices[n] for n in cfg.transfer.devices(r) if n in devices]
                 for r in ROLES}
        role_gpus = {r: sorted({i for inst in cfg.instances(r) for i in inst}) for r in ROLES}
    out = []
    for role, indices in role_gpus.items():
        for i in indices:
            if i in sites and (best := nearest(sites[i], lists[role])) is not None:
                out.append(Pair(role, sites[i], best[0], best[1]))
    return out


def _not_applicable(cfg: HostConfig | None) -> str:
    if cfg is not None and cfg.stack == "cpu":
        return "stack is cpu"
    if cfg is not None and cfg.transfer.protocol == "tcp":
        return "transfer.protocol is tcp"
    return ""


def check_nic_placement(cfg: HostConfig | None, probe: HostProbe) -> list[Check]:
    """One line per role: each GPU -> its NIC and their distance; a warning where a GPU's
    KV crosses the sockets' interconnect to reach its NIC."""
    names = [f"NICs ({r})" for r in ROLES]
    why = "no host config" if cfg is None else _not_applicable(cfg)
    if why:
        return [skipped(n, why) for n in names]
    pairs = _pairs(cfg, probe)
    active = [d.as_nic() for d in probe.rdma_devices() if d.active_ports]
    out = []
    for role, name in zip(ROLES, names, strict=True):
        mine = [p for p in pairs if p.role == role]
        if not mine:
            out.append(skipped(name, "no GPU with a listed RDMA device"))
            continue
        if all(p.distance is Distance.UNKNOWN for p in mine):
            out.append(skipped(name, "no PCI topology in /sys (GPU or NIC not found under "
                               "/sys/devices)"))
            continue
        detail = ", ".join(f"GPU {p.gpu.index} → {p.nic.name} {p.distance.name}"
                           for p in mine)
        far = [p for p in mine if p.distance is Distance.SYS]
        if not far:
            out.append(passed(name, detail))
            continue
        hints = []
        for p in far:
            best = nearest(p.gpu, active)
            if best is not None and best[1] < Distance.SYS:
                hints.append(f"{best[0].name} ({best[1].name}) for GPU {p.gpu.index}")
        fix = (f"list {', '.join(hints)} in transfer.{role}_devices" if hints else
               f"put a NIC on GPU {far[0].gpu.index}'s socket") + \
            " (`pdctl init --force` picks each GPU's nearest)"
        out.append(warned(name, f"{detail}: KV crosses the CPU sockets' interconnect (SYS)",
                         fix))
    return out


def check_acs(cfg: HostConfig | None, probe: HostProbe) -> Check:
    """ACS Request/Completion Redirect or Egress Control on a switch port between a GPU and
    its NIC turns their peer-to-peer traffic around at the root complex: slow, or hung
    where the IOMMU refuses it (NCCL's troubleshooting guide, "PCI Access Control
    Services")."""
    name = "PCIe ACS"
    why = _not_applicable(cfg)
    if why:
        return skipped(name, why)
    ports: dict[str, str] = {}  # port -> the GPU and NIC it lies between
    for p in _pairs(cfg, probe):
        if p.gpu.location is None or p.nic.location is None:
            continue
        for bdf in p2p_bridges(p.gpu.location, p.nic.location):
            ports.setdefault(bdf, f"GPU {p.gpu.index}-{p.nic.name}")
    if not ports:
        return skipped(name, "no PCIe switch between a GPU and its NIC (or no PCI topology)")
    redirecting, clear, unread = [], [], []
    for bdf, between in ports.items():
        ctrl, err = probe.acs_control(bdf)
        if err == "missing":
            return skipped(name, "setpci not found (pciutils): ACS not checked")
        if ctrl is None:
            unread.append(err)
        elif acs_redirects(ctrl):
            redirecting.append(f"{bdf} ({between}: {'+'.join(acs_flags(ctrl))})")
        else:
            clear.append(bdf)
    if redirecting:
        bdfs = [r.split(" ", 1)[0] for r in redirecting]
        return warned(name, f"ACS redirect on {', '.join(redirecting)}: GPUDirect RDMA goes "
                     "through the root complex",
                     f"disable ACS on these ports: in the firmware (IOMMU/VT-d/ACS "
                     f"settings), or `setpci -s {bdfs[0]} ECAP_ACS+6.w=0000` for each (until "
                     f"reboot), or boot with pci=disable_acs_redir={';'.join(bdfs)}")
    if not clear:
        return skipped(name, f"cannot read ACS control ({unread[0]}; run as root)")
    return passed(name, f"no ACS redirect on the {len(clear)} switch ports between GPUs and "
                 "NICs")
