"""Fake host trees (/sys, /proc, /dev under a root path) and a fake command runner."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance.pdctl.clibase import Env
from appliance.pdctl.runner import NOT_FOUND, CommandResult

UNLIMITED_LIMITS = """\
Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max locked memory         unlimited            unlimited            bytes
Max open files            1048576              1048576              files
"""
LOW_LIMITS = UNLIMITED_LIMITS.replace(
    "Max locked memory         unlimited            unlimited",
    "Max locked memory         8388608              8388608  ")
# NVIDIA's driver for CUDA 13.0 is 580.65.06 or later: the healthy host has 580.95.05.
DRIVER = "580.95.05"
PROC_VERSION = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Thu Sep 25 2025\n")
OPEN_VERSION = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {v}  Release Build\n")
DOCKERD_PID = 812
FULL_CAPS = "000001ffffffffff"
TCP_HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
              "  timeout inode\n")


def tcp_listen_line(port: int, slot: int = 0) -> str:
    return (f"   {slot}: 00000000:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 "
            f"00000000     0        0 1234 1 0000000000000000 100 0 0 10 0\n")


@dataclass
class FakeHost:
    """A healthy GPU + RDMA host; the methods break one thing each."""
    root: Path
    gpus: int = 2
    devices: tuple[str, ...] = ("mlx5_0",)
    cpus: str = "0-7"  # /sys/devices/system/cpu/online

    def build(self) -> FakeHost:
        r = self.root
        (r / "sys/devices/system/cpu").mkdir(parents=True)
        (r / "sys/devices/system/cpu/online").write_text(self.cpus + "\n")
        for i in range(self.gpus):
            self.proc_gpu(f"0000:{0x18 + i:02x}:00.0", i)
        (r / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
        (r / "proc/driver/nvidia/version").write_text(PROC_VERSION.format(v=DRIVER))
        (r / "proc/sys/kernel").mkdir(parents=True)
        (r / "proc/sys/kernel/osrelease").write_text("6.1.0-18-amd64\n")
        (r / "proc/self").mkdir(parents=True)
        (r / "proc/self/limits").write_text(UNLIMITED_LIMITS)
        # A rootful dockerd as systemd starts it: root, every capability, the default 8 MiB
        # memlock (it raises a container's limit as compose.yaml asks).
        self.dockerd(DOCKERD_PID, uid=0, caps=FULL_CAPS, limits=LOW_LIMITS)
        (r / "var/run").mkdir(parents=True)
        (r / "var/run/docker.pid").write_text(f"{DOCKERD_PID}\n")
        (r / "proc/net").mkdir(parents=True)
        (r / "proc/net/tcp").write_text(TCP_HEADER)
        (r / "proc/net/tcp6").write_text(TCP_HEADER)
        for name in self.devices:
            self.rdma_device(name)
        (r / "sys/module/nvidia_peermem").mkdir(parents=True)
        (r / "dev/infiniband").mkdir(parents=True)
        for node in ("uverbs0", "rdma_cm"):
            (r / "dev/infiniband" / node).write_text("")
        (r / "models/qwen").mkdir(parents=True)
        (r / "models/qwen/config.json").write_text("{}")
        return self

    def rdma_device(self, name: str) -> None:
        """An ACTIVE InfiniBand device without a PCI location (ib0 its netdev)."""
        port = self.root / "sys/class/infiniband" / name / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        (self.root / "sys/class/infiniband" / name / "device/net/ib0").mkdir(parents=True)

    def proc_gpu(self, bus: str, minor: int) -> None:
        d = self.root / "proc/driver/nvidia/gpus" / bus
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 1\n"
                                        f"Device Minor: \t {minor}\n")

    def dockerd(self, pid: int, uid: int, caps: str, limits: str) -> None:
        d = self.root / "proc" / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "comm").write_text("dockerd\n")
        (d / "status").write_text(f"Name:\tdockerd\nState:\tS (sleeping)\nPid:\t{pid}\n"
                                  f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nCapInh:\t0000000000000000\n"
                                  f"CapPrm:\t{caps}\nCapEff:\t{caps}\n")
        (d / "limits").write_text(limits)

    # ---- breakages ----------------------------------------------------------------------
    def cpu_only(self, runner: FakeRunner) -> None:
        """No NVIDIA driver, no RDMA NIC: a CPU host."""
        import shutil

        shutil.rmtree(self.root / "proc/driver/nvidia")
        shutil.rmtree(self.root / "sys/class/infiniband")
        for key in [k for k in runner.answers if k[0] == "nvidia-smi"]:
            runner.answers.pop(key)

    def no_peermem(self) -> None:
        (self.root / "sys/module/nvidia_peermem").rmdir()

    def open_kernel_modules(self) -> None:
        (self.root / "proc/driver/nvidia/version").write_text(OPEN_VERSION.format(v=DRIVER))

    def old_driver(self, runner: FakeRunner | None = None, version: str = "550.54.15") -> None:
        """A CUDA 12 driver: in /proc and, given the runner, in nvidia-smi's answer."""
        (self.root / "proc/driver/nvidia/version").write_text(PROC_VERSION.format(v=version))
        if runner is not None:
            runner.answer(["nvidia-smi", "--query-gpu=driver_version"], f"{version}\n" * 2)

    def rootless_dockerd(self, hard_memlock_unlimited: bool = False) -> None:
        """dockerd run by a user (rootless): full capabilities, but only in its own user
        namespace; its pid file lives in $XDG_RUNTIME_DIR, not /var/run."""
        import shutil

        shutil.rmtree(self.root / "proc" / str(DOCKERD_PID))
        (self.root / "var/run/docker.pid").unlink()
        limits = UNLIMITED_LIMITS if hard_memlock_unlimited else LOW_LIMITS
        self.dockerd(2345, uid=1000, caps=FULL_CAPS, limits=limits)

    def port_down(self, device: str = "mlx5_0") -> None:
        (self.root / "sys/class/infiniband" / device / "ports/1/state").write_text("1: DOWN\n")

    def no_dev_infiniband(self) -> None:
        for p in (self.root / "dev/infiniband").iterdir():
            p.unlink()
        (self.root / "dev/infiniband").rmdir()

    def low_memlock(self) -> None:
        (self.root / "proc/self/limits").write_text(LOW_LIMITS)

    def listening(self, *ports: int) -> None:
        lines = "".join(tcp_listen_line(p, i) for i, p in enumerate(ports))
        (self.root / "proc/net/tcp").write_text(TCP_HEADER + lines)


NVIDIA_SMI = "0, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559\n" \
             "1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559\n"
IP_ROUTE = json.dumps([{"dst": "default", "gateway": "192.168.1.1", "dev": "eno1",
                        "protocol": "dhcp", "flags": []}])
IP_ADDR = json.dumps([
    {"ifname": "lo", "addr_info": [{"local": "127.0.0.1", "scope": "host"}]},
    {"ifname": "eno1", "addr_info": [{"local": "192.168.1.20", "scope": "global"}]},
    {"ifname": "ib0", "addr_info": [{"local": "10.0.0.11", "scope": "global"}]},
])


@dataclass
class FakeRunner:
    """Answers commands by their first words; anything unknown is 'command not found'."""
    answers: dict[tuple[str, ...], CommandResult] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> CommandResult:
        self.calls.append(list(argv))
        best: tuple[str, ...] | None = None
        for key in self.answers:
            if tuple(argv[:len(key)]) == key and (best is None or len(key) > len(best)):
                best = key
        if best is None:
            return CommandResult(NOT_FOUND, stderr=f"{argv[0]}: command not found")
        return self.answers[best]

    def answer(self, prefix: Sequence[str], stdout: str = "", returncode: int = 0,
               stderr: str = "") -> FakeRunner:
        self.answers[tuple(prefix)] = CommandResult(returncode, stdout, stderr)
        return self


def healthy_runner() -> FakeRunner:
    return (FakeRunner()
            .answer(["nvidia-smi"], NVIDIA_SMI)
            .answer(["nvidia-smi", "--query-gpu=driver_version"], f"{DRIVER}\n{DRIVER}\n")
            .answer(["ip"], IP_ADDR)
            .answer(["ip", "-j", "route"], IP_ROUTE)
            .answer(["docker", "version"], "28.2.2\n")
            .answer(["docker", "compose", "version"], "2.40.3\n")
            .answer(["docker", "info"], '{"io.containerd.runc.v2":{},"nvidia":{},"runc":{}}\n')
            .answer(["docker", "compose", "--project-directory"], ""))


def env_for(root: Path, runner: FakeRunner) -> Env:
    from rich.console import Console

    return Env(root=root, runner=runner, console=Console(width=200, highlight=False,
                                                         color_system=None))
