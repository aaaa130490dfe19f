"""Read-only probes of the host: GPUs, RDMA devices, GPUDirect, memlock, ports, Docker.

Every file read goes through `root` (so /sys, /proc and /dev can be a fake tree in tests)
and every command through `runner` (nvidia-smi, ip, docker).
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from appliance.pdctl.host.composebin import Compose, find_compose
from appliance.pdctl.host.topology import (
    GpuSite,
    Nic,
    PciLocation,
    natural_key,
    normalize_bus_id,
    parse_rate_gbps,
    parse_sysfs_path,
)
from appliance.pdctl.runner import Runner, SubprocessRunner

UNLIMITED = -1
# "550.54.15" in nvidia-smi's answer or /proc/driver/nvidia/version's first line.
_DRIVER = re.compile(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str = ""
    memory_mib: int | None = None


@dataclass(frozen=True)
class RdmaPort:
    number: int
    state: str  # "ACTIVE", "DOWN", "INIT", ...
    rate: str = ""  # "200 Gb/sec (4X HDR)"
    link_layer: str = ""  # "InfiniBand" | "Ethernet"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    ports: tuple[RdmaPort, ...] = ()
    netdevs: tuple[str, ...] = ()
    location: PciLocation | None = None

    @property
    def active_ports(self) -> list[RdmaPort]:
        return [p for p in self.ports if p.active]

    @property
    def link_layer(self) -> str:
        port = next(iter(self.active_ports), None) or next(iter(self.ports), None)
        return port.link_layer if port else ""

    def as_nic(self) -> Nic:
        rate = max((parse_rate_gbps(p.rate) for p in self.active_ports), default=0.0)
        return Nic(self.name, self.location, rate, bool(self.active_ports), self.link_layer)


@dataclass(frozen=True)
class Daemon:
    """A running dockerd as /proc shows it."""
    pid: int
    uid: int | None
    cap_eff: int | None
    memlock: Memlock | None

    CAP_SYS_RESOURCE = 1 << 24

    @property
    def can_raise_limits(self) -> bool:
        """Root with CAP_SYS_RESOURCE in the host's namespace may raise a hard limit (a
        rootless daemon's capabilities live in its own user namespace and may not)."""
        return self.uid == 0 and self.cap_eff is not None and \
            bool(self.cap_eff & self.CAP_SYS_RESOURCE)


@dataclass(frozen=True)
class Memlock:
    soft: int  # bytes, or UNLIMITED
    hard: int

    @property
    def unlimited(self) -> bool:
        return self.soft == UNLIMITED and self.hard == UNLIMITED

    @staticmethod
    def describe(value: int) -> str:
        return "unlimited" if value == UNLIMITED else f"{value // 1024} KiB"


def split_cpus(cpus: list[int], most: int = 4) -> tuple[tuple[int, ...] | None,
                                                       tuple[int, ...] | None]:
    """P and D each on CPUs of their own (D busy-waits while it waits for KV): the first
    half for P, the second for D, at most `most` each. (None, None) below two CPUs."""
    if len(cpus) < 2:
        return None, None
    k = min(len(cpus) // 2, most)
    return tuple(cpus[:k]), tuple(cpus[k:2 * k])


@dataclass
class HostProbe:
    root: Path = Path("/")
    runner: Runner = field(default_factory=SubprocessRunner)

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def read(self, absolute: str) -> str | None:
        try:
            return self.path(absolute).read_text(errors="replace")
        except OSError:
            return None

    # ---- GPUs ---------------------------------------------------------------------------

    def gpus(self) -> tuple[list[Gpu], str]:
        """The NVIDIA GPUs, in nvidia-smi's index order, and where they were found."""
        res = self.runner.run(["nvidia-smi", "--query-gpu=index,name,pci.bus_id,memory.total",
                               "--format=csv,noheader,nounits"])
        if res.ok:
            gpus = []
            for line in res.stdout.splitlines():
                cols = [c.strip() for c in line.split(",")]
                if len(cols) >= 2 and cols[0].isdigit():
                    mem = int(cols[3]) if len(cols) > 3 and cols[3].isdigit() else None
                    gpus.append(Gpu(int(cols[0]), cols[1], cols[2] if len(cols) > 2 else "",
                                    mem))
            return sorted(gpus, key=lambda g: g.index), "nvidia-smi"
        # Without nvidia-smi (e.g. no utilities installed) the driver lists its GPUs in
        # /proc; nvidia-smi numbers them in PCI bus order, and so do we.
        base = self.path("/proc/driver/nvidia/gpus")
        if not base.is_dir():
            return [], "none"
        gpus = []
        for i, bus in enumerate(sorted(p.name for p in base.iterdir())):
            info = self.read(f"/proc/driver/nvidia/gpus/{bus}/information") or ""
            m = re.search(r"^Model:\s*(.+)$", info, re.MULTILINE)
            gpus.append(Gpu(i, m.group(1).strip() if m else "NVIDIA GPU", bus))
        return gpus, "/proc/driver/nvidia"

    def driver_version(self) -> str | None:
        text = self.read("/proc/driver/nvidia/version")
        return text.splitlines()[0].strip() if text else None

    def driver_release(self) -> tuple[str | None, str]:
        """The NVIDIA driver's version ("580.95.05") and where it was read."""
        res = self.runner.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"])
        if res.ok:
            m = _DRIVER.search(" " + res.stdout.strip().split("\n", 1)[0] + " ")
            if m:
                return m.group(1), "nvidia-smi"
        m = _DRIVER.search(self.driver_version() or "")
        return (m.group(1), "/proc/driver/nvidia/version") if m else (None, "")

    def gpu_sites(self, gpus: list[Gpu]) -> list[GpuSite]:
        return [GpuSite(g.index, self.pci_location(normalize_bus_id(g.bus_id))
                        if g.bus_id else None) for g in gpus]

    # ---- PCI topology -------------------------------------------------------------------

    def pci_location(self, bdf: str) -> PciLocation | None:
        """Where a PCI function sits: /sys/bus/pci/devices/<bdf> links into /sys/devices."""
        return self._location(self.path(f"/sys/bus/pci/devices/{bdf}"))

    def _location(self, link: Path) -> PciLocation | None:
        if not link.exists():
            return None
        real = Path(os.path.realpath(link))
        try:
            rel = real.relative_to(Path(os.path.realpath(self.root)))
        except ValueError:
            return None
        numa = _text(real / "numa_node")
        return parse_sysfs_path("/" + str(rel), int(numa) if re.fullmatch(r"-?\d+", numa) else -1)

    def acs_control(self, bdf: str) -> tuple[int | None, str]:
        """A bridge's ACS Control register (setpci), or None and why: "missing" when there is
        no setpci, else setpci's complaint (no ACS capability, not root)."""
        res = self.runner.run(["setpci", "-s", bdf, "ECAP_ACS+6.w"])
        if res.missing:
            return None, "missing"
        text = res.stdout.strip()
        if res.ok and re.fullmatch(r"[0-9a-fA-F]{1,4}", text):
            return int(text, 16), ""
        return None, (res.stderr.strip() or text or res.reason())

    # ---- CPUs ---------------------------------------------------------------------------

    def cpus(self) -> list[int]:
        """The online CPUs (sysfs), or where that cannot be read, the ones this process may
        run on."""
        text = self.read("/sys/devices/system/cpu/online")
        if text:
            try:
                return parse_cpu_list(text)
            except ValueError:
                pass
        return sorted(os.sched_getaffinity(0))

    # ---- RDMA ---------------------------------------------------------------------------

    def rdma_devices(self) -> list[RdmaDevice]:
        base = self.path("/sys/class/infiniband")
        if not base.is_dir():
            return []
        devices = []
        for dev in sorted(base.iterdir(), key=lambda p: natural_key(p.name)):
            ports = []
            ports_dir = dev / "ports"
            if ports_dir.is_dir():
                for port in sorted(ports_dir.iterdir(), key=lambda p: p.name):
                    if not port.name.isdigit():
                        continue
                    ports.append(RdmaPort(int(port.name), _port_state(_text(port / "state")),
                                          _text(port / "rate"), _text(port / "link_layer")))
            net = dev / "device" / "net"
            netdevs = tuple(sorted(p.name for p in net.iterdir())) if net.is_dir() else ()
            devices.append(RdmaDevice(dev.name, tuple(ports), netdevs,
                                      self._location(dev / "device")))
        return devices

    def rdma_device(self, name: str) -> RdmaDevice | None:
        return next((d for d in self.rdma_devices() if d.name == name), None)

    def infiniband_dev_nodes(self) -> list[str]:
        base = self.path("/dev/infiniband")
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir())

    # ---- GPUDirect ----------------------------------------------------------------------

    def peermem_loaded(self) -> bool:
        return self.path("/sys/module/nvidia_peermem").is_dir()

    def dmabuf_usable(self) -> tuple[bool, str]:
        """DMA-BUF GPUDirect needs NVIDIA's open kernel modules and Linux >= 5.12."""
        version = self.driver_version()
        if version is None:
            return False, "no NVIDIA driver (/proc/driver/nvidia/version)"
        if "Open Kernel Module" not in version:
            return False, "the NVIDIA driver is the proprietary kernel module (DMA-BUF needs " \
                          "the open kernel modules)"
        release = (self.read("/proc/sys/kernel/osrelease") or "").strip()
        m = re.match(r"(\d+)\.(\d+)", release)
        if not m or (int(m.group(1)), int(m.group(2))) < (5, 12):
            return False, f"kernel {release or 'unknown'} is older than 5.12"
        return True, f"open kernel modules, kernel {release}"

    # ---- limits and ports ---------------------------------------------------------------

    def memlock(self, pid: str = "self") -> Memlock | None:
        text = self.read(f"/proc/{pid}/limits")
        if text is None:
            return None
        for line in text.splitlines():
            if line.startswith("Max locked memory"):
                cols = line[len("Max locked memory"):].split()
                if len(cols) >= 2:
                    return Memlock(_limit(cols[0]), _limit(cols[1]))
        return None

    def dockerd(self) -> Daemon | None:
        """The Docker daemon: docker.pid's process if it is dockerd, else the first dockerd
        in /proc (a rootless one keeps its pid file in $XDG_RUNTIME_DIR)."""
        pid = (self.read("/var/run/docker.pid") or "").strip()
        if not (pid.isdigit() and self._comm(pid) == "dockerd"):
            proc = self.path("/proc")
            found = sorted(int(p.name) for p in proc.iterdir()
                           if p.name.isdigit() and self._comm(p.name) == "dockerd") \
                if proc.is_dir() else []
            if not found:
                return None
            pid = str(found[0])
        status = self.read(f"/proc/{pid}/status") or ""
        uid = re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)
        cap = re.search(r"^CapEff:\s+([0-9a-fA-F]+)", status, re.MULTILINE)
        return Daemon(int(pid), int(uid.group(1)) if uid else None,
                      int(cap.group(1), 16) if cap else None, self.memlock(pid))

    def _comm(self, pid: str) -> str:
        return (self.read(f"/proc/{pid}/comm") or "").strip()

    def listening_ports(self) -> set[int] | None:
        """TCP ports something listens on (IPv4 and IPv6); None when /proc/net is unreadable."""
        found: set[int] = set()
        readable = False
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            text = self.read(name)
            if text is None:
                continue
            readable = True
            for line in text.splitlines()[1:]:
                cols = line.split()
                if len(cols) > 3 and cols[3] == "0A":  # TCP_LISTEN
                    found.add(int(cols[1].rsplit(":", 1)[1], 16))
        return found if readable else None

    # ---- addresses ----------------------------------------------------------------------

    def addresses(self) -> dict[str, str]:
        """Each interface's first global IPv4 address, in `ip`'s order."""
        res = self.runner.run(["ip", "-j", "-4", "addr", "show"])
        addrs: dict[str, str] = {}
        for iface in _json_list(res.stdout if res.ok else ""):
            for info in iface.get("addr_info", []):
                if info.get("scope") == "global" and info.get("local"):
                    addrs.setdefault(iface.get("ifname", ""), info["local"])
        return addrs

    def default_route_dev(self) -> str | None:
        res = self.runner.run(["ip", "-j", "route", "show", "default"])
        routes = _json_list(res.stdout if res.ok else "")
        return next((r["dev"] for r in routes if r.get("dev")), None)

    def host_ip(self, prefer_netdevs: tuple[str, ...] = ()) -> tuple[str | None, str]:
        """(address, where it is from): the first of `prefer_netdevs` with an address, else
        the primary one (the default route's interface, else the first global address)."""
        addrs = self.addresses()
        for dev in prefer_netdevs:
            if dev in addrs:
                return addrs[dev], f"{dev}, the RDMA NIC's netdev"
        dev = self.default_route_dev()
        if dev in addrs:
            return addrs[dev], f"{dev}, the default route's interface"
        if addrs:
            dev, ip = next(iter(addrs.items()))
            return ip, f"{dev}, the first global address"
        try:  # no packet is sent: connect() on UDP only picks the route's source address
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("192.0.2.1", 9))
                return s.getsockname()[0], "the default route's source address"
        except OSError:
            return None, ""

    # ---- Docker -------------------------------------------------------------------------

    def docker_server_version(self) -> tuple[str | None, str]:
        res = self.runner.run(["docker", "version", "--format", "{{.Server.Version}}"])
        if res.ok and res.stdout.strip():
            return res.stdout.strip(), ""
        return None, "docker CLI not found" if res.missing else res.reason()

    def compose(self) -> tuple[Compose | None, str]:
        return find_compose(self.runner)

    def docker_runtimes(self) -> tuple[list[str] | None, str]:
        res = self.runner.run(["docker", "info", "--format", "{{json .Runtimes}}"])
        if not res.ok:
            return None, res.reason()
        try:
            return sorted(json.loads(res.stdout or "{}")), ""
        except ValueError:
            return None, f"unreadable output of docker info: {res.stdout[:80]!r}"


def parse_cpu_list(text: str) -> list[int]:
    """Linux's CPU list syntax ("0-3,8,10-11") as sorted CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(first, last + 1))
    return sorted(out)


def _json_list(text: str) -> list[dict]:
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return []
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _port_state(raw: str) -> str:
    # sysfs says e.g. "4: ACTIVE"
    return raw.split(":", 1)[-1].strip() if raw else "UNKNOWN"


def _limit(raw: str) -> int:
    return UNLIMITED if raw == "unlimited" else int(raw)
