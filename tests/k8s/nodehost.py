"""Host-side parts of a test node (node.py): its cgroups, its processes found by
namespace or cgroup, and the host state it must leave as it was."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup")
# Global (not per network namespace) sysctls kubelet sets at start.
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


def alive(pid: int) -> bool:
    """Running (a zombie child of ours is reaped, not counted)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[-1][:1] != "Z"
    except OSError:
        return False


def kill_group(pid: int, grace: float = 10.0) -> None:
    """SIGTERM to the process group `pid` leads, SIGKILL after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)


def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones, the v2 one)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fstype = line.split(" - ", 1)[1].split()[0]
        mount = Path(line.split()[4])
        if fstype in ("cgroup", "cgroup2") and mount.is_relative_to(CGROUPS):
            out.append(mount)
    return out


def make_cgroup_root(name: str) -> None:
    """kubelet wants its cgroupRoot to exist in every hierarchy (cpuset filled from the
    parent, or no task could join it)."""
    for h in hierarchies():
        if h.name == "unified":
            continue
        (h / name.lstrip("/")).mkdir()
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (h / f).exists():
                (h / name.lstrip("/") / f).write_text((h / f).read_text())


def cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for h in hierarchies():
        top = h / name.lstrip("/")
        for procs in top.rglob("cgroup.procs") if top.is_dir() else ():
            try:
                pids |= {int(p) for p in procs.read_text().split()}
            except OSError:
                pass
    return pids


def remove_cgroups(name: str) -> list[str]:
    left = []
    for h in hierarchies():
        top = h / name.lstrip("/")
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _rmdir(d)
        if not _rmdir(top):
            left.append(f"cgroup {top}")
    return left


def _rmdir(d: Path) -> bool:
    for _ in range(50):  # a task that just exited may linger for a moment
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


def in_mount_ns(ns: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "mnt") == ns:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def host_state() -> dict[str, str]:
    """What the node must leave as it was: the host's global sysctls it touches or might,
    its iptables rules (counters left out) and its links."""
    state = {name: Path("/proc/sys", name).read_text() for name in
             (*SYSCTLS, "net/ipv4/ip_forward", "net/ipv4/conf/all/route_localnet")}
    for tool in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([tool], capture_output=True, text=True).stdout
        state[tool] = "\n".join(re.sub(r"\[\d+:\d+\]", "", line) for line in out.splitlines()
                                if not line.startswith("#"))
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    state["links"] = " ".join(sorted(line.split(":")[1].strip() for line in links.splitlines()))
    return state


@dataclass
class Traces:
    """What a node started, recorded so a run killed midway is cleared by the next."""
    netns: str
    cgroup_root: str
    run: str
    work: str
    holder: int | None = None
    containerd: int | None = None
    pids: list[int] = field(default_factory=list)  # the others' process groups, newest first

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    def ours(self, pid: int | None) -> bool:
        """Still the process recorded (a killed run's pid may have been reused): the holder
        is in the node's network namespace, the others name its folders."""
        if pid is None or not alive(pid):
            return False
        try:
            if pid == self.holder:
                return (os.stat(f"/proc/{pid}/ns/net").st_ino
                        == os.stat(f"/run/netns/{self.netns}").st_ino)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        return self.run in cmdline or self.work in cmdline
