"""Which RDMA NIC each GPU should use: PCI distance arithmetic, no file reads.

The classes follow `nvidia-smi topo -m`: PIX (one PCIe switch between them), PXB (several
switches, no host bridge), PHB (through one PCIe host bridge), NODE (between host bridges
of one NUMA node), SYS (across the sockets' interconnect). GPUDirect RDMA through a host
bridge or across sockets is slower, and often much slower, than through a shared switch,
so each GPU takes the nearest ACTIVE NIC (probe.py reads the sysfs paths).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class Distance(IntEnum):
    PIX = 1
    PXB = 2
    PHB = 3
    NODE = 4
    SYS = 5
    UNKNOWN = 6  # no PCI location in sysfs (a virtual device, a fake or container /sys)

    @property
    def meaning(self) -> str:
        return _MEANING[self]


_MEANING = {
    Distance.PIX: "same PCIe switch",
    Distance.PXB: "PCIe switches, no host bridge",
    Distance.PHB: "through the PCIe host bridge",
    Distance.NODE: "between host bridges of one NUMA node",
    Distance.SYS: "across CPU sockets",
    Distance.UNKNOWN: "no PCI topology",
}


@dataclass(frozen=True)
class PciLocation:
    """Where a PCI function sits: its host bridge ("pci0000:17"), the bridges from the root
    port down to it, its own address and its NUMA node (-1: not reported)."""
    root: str
    bridges: tuple[str, ...]
    bdf: str
    numa: int = -1


def parse_sysfs_path(path: str, numa: int = -1) -> PciLocation | None:
    """A resolved /sys/devices path ("/sys/devices/pci0000:17/0000:17:01.0/.../0000:1a:00.0",
    possibly with a tail such as "/infiniband/mlx5_0") as a PciLocation; None off PCI."""
    parts = [p for p in path.split("/") if p]
    if "devices" not in parts:
        return None
    parts = parts[parts.index("devices") + 1:]
    if not parts or not parts[0].startswith("pci"):
        return None
    chain = []
    for part in parts[1:]:
        if not _BDF.match(part):
            break
        chain.append(part)
    if not chain:
        return None
    return PciLocation(parts[0], tuple(chain[:-1]), chain[-1], numa)


def normalize_bus_id(bus_id: str) -> str:
    """nvidia-smi's "00000000:18:00.0" as sysfs names it: "0000:18:00.0"."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if not sep:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}" if re.fullmatch(r"[0-9a-f]+", domain) else bus_id


def _split(a: PciLocation, b: PciLocation) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """How many bridges a and b share from the root port down, and each one's bridges below."""
    n = 0
    while n < min(len(a.bridges), len(b.bridges)) and a.bridges[n] == b.bridges[n]:
        n += 1
    return n, a.bridges[n:], b.bridges[n:]


def distance(a: PciLocation | None, b: PciLocation | None) -> Distance:
    if a is None or b is None:
        return Distance.UNKNOWN
    if a.root == b.root:
        shared, tail_a, tail_b = _split(a, b)
        if not shared:
            return Distance.PHB
        # Below a shared switch each side passes one downstream port: more means a second
        # switch on the way.
        return Distance.PIX if len(tail_a) <= 1 and len(tail_b) <= 1 else Distance.PXB
    # A NUMA node of -1 is a host that does not report them (one socket).
    if a.numa < 0 or b.numa < 0 or a.numa == b.numa:
        return Distance.NODE
    return Distance.SYS


def p2p_bridges(a: PciLocation, b: PciLocation) -> tuple[str, ...]:
    """The ports a peer-to-peer transfer between a and b crosses below their shared switch,
    where ACS redirect would send it up to the root complex instead; none where the path
    goes through a host bridge anyway."""
    if distance(a, b) not in (Distance.PIX, Distance.PXB):
        return ()
    _shared, tail_a, tail_b = _split(a, b)
    return tail_a + tail_b


def natural_key(name: str) -> tuple[object, ...]:
    """mlx5_2 before mlx5_10."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class Nic:
    name: str
    location: PciLocation | None
    rate_gbps: float = 0.0
    active: bool = True
    link_layer: str = ""  # "InfiniBand" | "Ethernet"


@dataclass(frozen=True)
class GpuSite:
    index: int
    location: PciLocation | None


@dataclass(frozen=True)
class Choice:
    role: str
    gpu: int
    nic: str
    distance: Distance


def parse_rate_gbps(rate: str) -> float:
    """sysfs's "400 Gb/sec (4X NDR)" as 400.0; 0.0 when unreadable."""
    m = re.match(r"\s*([\d.]+)\s*Gb", rate)
    return float(m.group(1)) if m else 0.0


def assign_nics(roles: dict[str, Sequence[GpuSite]], nics: Sequence[Nic]) -> list[Choice]:
    """Each role's GPU -> its nearest ACTIVE NIC.

    Nearest first; among equally near ones a NIC no other GPU took yet (P and D, or two
    GPUs of one role, on NICs of their own where the host has them), then the faster, then
    the first by natural name. GPUs whose best NIC is nearer choose first, so a GPU with
    no NIC of its own does not take another GPU's switch-mate. Choices come back in role
    order, then GPU order."""
    active = [n for n in nics if n.active]
    if not active:
        return []
    pending = [(role, gpu) for role, gpus in roles.items() for gpu in gpus]
    best = {(role, g.index): min(distance(g.location, n.location) for n in active)
            for role, g in pending}
    order = sorted(range(len(pending)),
                   key=lambda i: (best[(pending[i][0], pending[i][1].index)], i))
    used: dict[str, int] = {}
    picked: dict[int, Choice] = {}
    for i in order:
        role, gpu = pending[i]

        def rank(n: Nic, gpu: GpuSite = gpu) -> tuple[object, ...]:
            return (distance(gpu.location, n.location), used.get(n.name, 0), -n.rate_gbps,
                    natural_key(n.name))

        nic = min(active, key=rank)
        used[nic.name] = used.get(nic.name, 0) + 1
        picked[i] = Choice(role, gpu.index, nic.name, distance(gpu.location, nic.location))
    return [picked[i] for i in range(len(pending))]


def role_devices(choices: Sequence[Choice], role: str) -> list[str]:
    """A role's NICs for Mooncake's device_name: each of its GPUs' choice, once, GPU order."""
    out: list[str] = []
    for c in choices:
        if c.role == role and c.nic not in out:
            out.append(c.nic)
    return out


def nearest(gpu: GpuSite, nics: Sequence[Nic]) -> tuple[Nic, Distance] | None:
    """The NIC Mooncake would take for this GPU's buffers among `nics` (it, too, prefers the
    nearest); None when there is none."""
    if not nics:
        return None
    nic = min(nics, key=lambda n: (distance(gpu.location, n.location), -n.rate_gbps,
                                   natural_key(n.name)))
    return nic, distance(gpu.location, nic.location)


# ACS Control register (extended capability ACS, offset 6), PCIe base spec 6.12; the bit
# names are Linux's (include/uapi/linux/pci_regs.h). Request/Completion Redirect and Egress
# Control send peer-to-peer requests up to the root complex (and its IOMMU): the bits
# Linux's pci=disable_acs_redir= clears "to always allow passing P2P traffic".
ACS_BITS = {0x01: "SrcValid", 0x02: "TransBlk", 0x04: "ReqRedir", 0x08: "CmpltRedir",
            0x10: "UpstreamFwd", 0x20: "EgressCtrl", 0x40: "DirectTrans"}
ACS_REDIRECTING = 0x04 | 0x08 | 0x20


def acs_flags(ctrl: int) -> list[str]:
    return [name for bit, name in ACS_BITS.items() if ctrl & bit]


def acs_redirects(ctrl: int) -> bool:
    return bool(ctrl & ACS_REDIRECTING)
