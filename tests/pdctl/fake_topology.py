"""Fake PCIe trees under a fake root, laid out as the kernel does: /sys/devices/pci<dom:bus>/
<root port>/<switch ports>/<device>, /sys/bus/pci/devices/<bdf> and /sys/class/infiniband/
<dev> as relative links into it. Two hosts: a workstation and an HGX H100."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tests.pdctl.fakes import IP_ROUTE, FakeHost, FakeRunner, healthy_runner

NDR = "400 Gb/sec (4X NDR)"


@dataclass
class PciTree:
    root: Path

    def device(self, path: str, numa: int) -> Path:
        """`path` below /sys/devices, e.g. "pci0000:00/0000:00:01.0/0000:03:00.0"."""
        d = self.root / "sys/devices" / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{numa}\n")
        bus = self.root / "sys/bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../devices/{path}", bus / d.name)
        return d

    def gpu(self, host: FakeHost, path: str, numa: int, minor: int) -> str:
        bdf = self.device(path, numa).name
        host.proc_gpu(bdf, minor)
        return bdf

    def nic(self, name: str, path: str, numa: int, rate: str = NDR,
            link_layer: str = "InfiniBand", netdev: str = "", state: str = "4: ACTIVE") -> None:
        d = self.device(path, numa)
        ib = d / "infiniband" / name
        port = ib / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "rate").write_text(rate + "\n")
        (port / "link_layer").write_text(link_layer + "\n")
        os.symlink(f"../../../{d.name}", ib / "device")
        if netdev:
            (d / "net" / netdev).mkdir(parents=True)
        cls = self.root / "sys/class/infiniband"
        cls.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../devices/{path}/infiniband/{name}", cls / name)


def _smi(bdfs: list[str]) -> str:
    return "".join(f"{i}, NVIDIA H100 80GB HBM3, 0000{b.upper()}, 81559\n"
                   for i, b in enumerate(bdfs))


def _ip(addrs: dict[str, str]) -> str:
    return json.dumps([{"ifname": "lo", "addr_info": [{"local": "127.0.0.1", "scope": "host"}]}]
                      + [{"ifname": dev, "addr_info": [{"local": ip, "scope": "global"}]}
                         for dev, ip in addrs.items()])


def workstation(root: Path) -> tuple[FakeHost, FakeRunner]:
    """Two GPUs and a ConnectX (RoCE, 100 Gb/s) behind one PCIe switch on one root port;
    the board's Broadcom RDMA NIC (RoCE, 25 Gb/s) on the chipset's root port: same host
    bridge, no switch shared (PHB). Name order would pick bnxt_re0."""
    host = FakeHost(root, gpus=0, devices=()).build()
    tree = PciTree(root)
    switch = "pci0000:00/0000:00:01.0/0000:01:00.0"
    gpus = [tree.gpu(host, f"{switch}/0000:02:0{i}.0/0000:0{3 + i}:00.0", 0, i)
            for i in range(2)]
    tree.nic("mlx5_0", f"{switch}/0000:02:02.0/0000:05:00.0", 0, "100 Gb/sec (4X EDR)",
             "Ethernet", "enp5s0np0")
    tree.nic("bnxt_re0", "pci0000:00/0000:00:1c.0/0000:06:00.0", 0, "25 Gb/sec (1X EDR)",
             "Ethernet", "eno1")
    runner = healthy_runner().answer(["nvidia-smi"], _smi(gpus)).answer(
        ["ip"], _ip({"eno1": "192.168.1.20", "enp5s0np0": "10.1.0.5"}))
    return host, runner


# The HGX H100 board: per socket four PCIe switches, each with one H100 and its ConnectX-7
# (InfiniBand NDR); two dual-port storage/management ConnectX-7s (RoCE, 200 Gb/s) on the
# CPUs' own root ports. Compute NICs by GPU: GPUs 0-3 mlx5_0..3, GPUs 4-7 mlx5_6, mlx5_7,
# mlx5_10, mlx5_11; storage mlx5_4, mlx5_5 (socket 0) and mlx5_8, mlx5_9 (socket 1).
HGX_SWITCH_BUS = (0x15, 0x26, 0x37, 0x48, 0x95, 0xA6, 0xB7, 0xC8)
HGX_NICS = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_10", "mlx5_11")
HGX_STORAGE = {"mlx5_4": (0x59, 0, ".0"), "mlx5_5": (0x59, 0, ".1"),
               "mlx5_8": (0xD9, 1, ".0"), "mlx5_9": (0xD9, 1, ".1")}


def hgx_switch_port(gpu: int, nic: bool = False) -> str:
    """The switch's downstream port above GPU `gpu` (or above its NIC)."""
    return f"0000:{HGX_SWITCH_BUS[gpu] + 2:02x}:0{int(nic)}.0"


def hgx_h100(root: Path) -> tuple[FakeHost, FakeRunner]:
    host = FakeHost(root, gpus=0, devices=()).build()
    tree = PciTree(root)
    gpus = []
    for i, bus in enumerate(HGX_SWITCH_BUS):
        numa = i // 4
        switch = f"pci0000:{bus:02x}/0000:{bus:02x}:01.0/0000:{bus + 1:02x}:00.0"
        gpus.append(tree.gpu(host, f"{switch}/{hgx_switch_port(i)}/0000:{bus + 3:02x}:00.0",
                             numa, i))
        tree.nic(HGX_NICS[i], f"{switch}/{hgx_switch_port(i, True)}/0000:{bus + 4:02x}:00.0",
                 numa, netdev=f"ib{i}")
    for name, (bus, numa, fn) in HGX_STORAGE.items():
        tree.nic(name, f"pci0000:{bus:02x}/0000:{bus:02x}:01.0/0000:{bus + 1:02x}:00{fn}",
                 numa, "200 Gb/sec (4X HDR)", "Ethernet", f"enp{bus + 1}s0f{fn[-1]}np{fn[-1]}")
    runner = healthy_runner().answer(["nvidia-smi"], _smi(gpus)).answer(
        ["ip"], _ip({"eno1": "192.168.1.20", **{f"ib{i}": f"10.0.{i}.11" for i in range(8)}}))
    runner.answer(["ip", "-j", "route"], IP_ROUTE)
    return host, runner
