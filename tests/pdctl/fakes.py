"""Fake host trees (/sys, /proc, /dev under a root path) and a fake command runner."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance.pdctl.cli import Env
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
            bus = f"0000:{0x18 + i:02x}:00.0"
            d = r / "proc/driver/nvidia/gpus" / bus
            d.mkdir(parents=True)
            (d / "information").write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 1\n"
                                            f"Device Minor: \t {i}\n")
        (r / "proc/driver/nvidia/version").write_text(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n")
        (r / "proc/sys/kernel").mkdir(parents=True)
        (r / "proc/sys/kernel/osrelease").write_text("6.1.0-18-amd64\n")
        (r / "proc/self").mkdir(parents=True)
        (r / "proc/self/limits").write_text(UNLIMITED_LIMITS)
        (r / "proc/net").mkdir(parents=True)
        (r / "proc/net/tcp").write_text(TCP_HEADER)
        (r / "proc/net/tcp6").write_text(TCP_HEADER)
        for name in self.devices:
            port = r / "sys/class/infiniband" / name / "ports/1"
            port.mkdir(parents=True)
            (port / "state").write_text("4: ACTIVE\n")
            (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
            (port / "link_layer").write_text("InfiniBand\n")
            (r / "sys/class/infiniband" / name / "device/net/ib0").mkdir(parents=True)
        (r / "sys/module/nvidia_peermem").mkdir(parents=True)
        (r / "dev/infiniband").mkdir(parents=True)
        for node in ("uverbs0", "rdma_cm"):
            (r / "dev/infiniband" / node).write_text("")
        (r / "models/qwen").mkdir(parents=True)
        (r / "models/qwen/config.json").write_text("{}")
        return self

    # ---- breakages ----------------------------------------------------------------------
    def cpu_only(self, runner: FakeRunner) -> None:
        """No NVIDIA driver, no RDMA NIC: a CPU host."""
        import shutil

        shutil.rmtree(self.root / "proc/driver/nvidia")
        shutil.rmtree(self.root / "sys/class/infiniband")
        runner.answers.pop(("nvidia-smi",), None)

    def no_peermem(self) -> None:
        (self.root / "sys/module/nvidia_peermem").rmdir()

    def open_kernel_modules(self) -> None:
        (self.root / "proc/driver/nvidia/version").write_text(
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build\n")

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
            .answer(["ip"], IP_ADDR)
            .answer(["docker", "version"], "28.2.2\n")
            .answer(["docker", "compose", "version"], "2.40.3\n")
            .answer(["docker", "info"], '{"io.containerd.runc.v2":{},"nvidia":{},"runc":{}}\n')
            .answer(["docker", "compose", "--project-directory"], ""))


def env_for(root: Path, runner: FakeRunner) -> Env:
    from rich.console import Console

    return Env(root=root, runner=runner, console=Console(width=200, highlight=False,
                                                         color_system=None))
