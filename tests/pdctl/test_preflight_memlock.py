"""The RDMA preflight's memlock check under a pod's real limits: a pod spec cannot raise
RLIMIT_MEMLOCK (the runtime's default is 8 MiB) but can add CAP_IPC_LOCK, which lifts the
limit for locking memory; so a finite memlock passes with the capability effective, and
fails, saying both fixes, without it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.pdctl.fakes import FakeHost

PREFLIGHT = ROOT / "images/base/pd-preflight.sh"
# /proc/self/status CapEff masks: a root container's default set, and with IPC_LOCK (bit 14)
DEFAULT_CAPS = "00000000a80425fb"
WITH_IPC_LOCK = "00000000a80465fb"


def _status(cap_eff: str) -> str:
    return (f"Name:\tsh\nState:\tR (running)\nCapInh:\t0000000000000000\n"
            f"CapPrm:\t{cap_eff}\nCapEff:\t{cap_eff}\nCapBnd:\t{cap_eff}\n")


@pytest.fixture
def pod(tmp_path: Path) -> FakeHost:
    """A GPU + RDMA node as a pod sees it: memlock at the runtime's 8 MiB."""
    host = FakeHost(tmp_path / "root").build()
    host.low_memlock()
    return host


def _run(host: FakeHost, shell: str, cap_eff: str | None) -> subprocess.CompletedProcess:
    if cap_eff is not None:
        (host.root / "proc/self/status").write_text(_status(cap_eff))
    env = {"PATH": os.environ["PATH"], "PD_PROTOCOL": "rdma", "PD_RDMA_DEVICE": "mlx5_0",
           "PD_PREFLIGHT_ROOT": str(host.root)}
    return subprocess.run([shell, str(PREFLIGHT)], capture_output=True, text=True,
                          timeout=30, env=env)


SHELLS = [s for s in ("sh", "dash", "bash") if any(
    (Path(d) / s).exists() for d in os.environ["PATH"].split(os.pathsep))]


@pytest.mark.parametrize("shell", SHELLS)
def test_finite_memlock_with_ipc_lock_is_ok(pod: FakeHost, shell: str) -> None:
    res = _run(pod, shell, WITH_IPC_LOCK)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        "pd-preflight: ok: mlx5_0 port 1 ACTIVE (200 Gb/sec (4X HDR)), uverbs0, "
        "memlock 8388608 bytes with CAP_IPC_LOCK, GPUDirect via nvidia_peermem")


@pytest.mark.parametrize("cap_eff", [DEFAULT_CAPS, None, "0000000000000000", "garbage!"])
@pytest.mark.parametrize("shell", SHELLS)
def test_finite_memlock_without_ipc_lock_fails(pod: FakeHost, shell: str,
                                               cap_eff: str | None) -> None:
    res = _run(pod, shell, cap_eff)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0] == (
        "pd-preflight: error: memlock is 8388608 bytes, not unlimited, and CAP_IPC_LOCK is "
        "not effective: RDMA pins the KV cache (compose.yaml: ulimits memlock -1 and cap_add "
        "IPC_LOCK; Kubernetes: securityContext.capabilities.add [IPC_LOCK])")


def test_unlimited_memlock_needs_no_capability(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "root").build()
    res = _run(host, "sh", DEFAULT_CAPS)
    assert res.returncode == 0 and "memlock unlimited" in res.stdout, res.stderr


def test_a_short_mask_is_read_too(pod: FakeHost) -> None:
    """Bit 14 in a mask shorter than the kernel's 16 digits (no leading zeros)."""
    assert _run(pod, "sh", "4000").returncode == 0
    assert _run(pod, "sh", "3fff").returncode == 1
