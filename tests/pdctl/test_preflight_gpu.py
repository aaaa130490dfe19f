"""The GPU image's preflight and entrypoint on fake host trees: the NVIDIA driver check
(PD_MIN_DRIVER, GPU image only, any protocol) and the GPUDirect path, which the entrypoint
hands to Mooncake as WITH_NVIDIA_PEERMEM (1: ibv_reg_mr through nvidia_peermem, Mooncake's
default when unset; 0: DMA-BUF)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.pdctl.fakes import FakeHost, FakeRunner

PREFLIGHT = ROOT / "images/base/pd-preflight.sh"
ENTRYPOINT = ROOT / "images/base/pd-entrypoint.sh"
NEED = "580.65.06"
SHOW = ["sh", "-c", 'echo "WITH_NVIDIA_PEERMEM=${WITH_NVIDIA_PEERMEM-unset}"']
SHELLS = [s for s in ("sh", "dash", "bash") if any(
    (Path(d) / s).exists() for d in os.environ["PATH"].split(os.pathsep))]


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path / "root").build()


def driver(host: FakeHost, version: str, open_modules: bool = False) -> None:
    kind = "Open Kernel Module for x86_64" if open_modules else "x86_64 Kernel Module"
    (host.root / "proc/driver/nvidia/version").write_text(
        f"NVRM version: NVIDIA UNIX {kind}  {version}  Release Build  Thu Sep 25 2025\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def _env(host: FakeHost, env: dict[str, str]) -> dict[str, str]:
    # PD_NVIDIA_SMI: never this machine's own nvidia-smi
    return {"PATH": os.environ["PATH"], "PD_PREFLIGHT_ROOT": str(host.root),
            "PD_NVIDIA_SMI": str(host.root / "no-nvidia-smi"), "PD_PROTOCOL": "rdma", **env}


def preflight(host: FakeHost, shell: str = "sh", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([shell, str(PREFLIGHT)], capture_output=True, text=True, timeout=30,
                          env=_env(host, env))


def entrypoint(host: FakeHost, shell: str = "sh", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([shell, str(ENTRYPOINT), *SHOW], capture_output=True, text=True,
                          timeout=30, env=_env(host, {"PD_PREFLIGHT_BIN": str(PREFLIGHT), **env}))


def mooncake_sees(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()[-1].split("=", 1)[1]


def one_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 1, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd-preflight: error: "), res.stderr
    return lines[0]


# ---- GPUDirect: the path the preflight checked reaches Mooncake --------------------------

@pytest.mark.parametrize("shell", SHELLS)
def test_auto_on_a_peermem_host_tells_mooncake_peermem(host, shell):
    res = entrypoint(host, shell, PD_GPUDIRECT="auto")
    assert mooncake_sees(res) == "1"
    assert "GPUDirect via nvidia_peermem" in res.stdout
    assert "PD_GPUDIRECT_MODE" not in res.stdout  # the hand-over line is not logged


@pytest.mark.parametrize("shell", SHELLS)
def test_auto_on_a_dmabuf_only_host_tells_mooncake_dmabuf(host, shell):
    host.no_peermem()
    driver(host, "580.95.05", open_modules=True)  # kernel 6.1 (FakeHost)
    res = entrypoint(host, shell, PD_GPUDIRECT="auto")
    assert mooncake_sees(res) == "0"
    assert "GPUDirect via DMA-BUF" in res.stdout


def test_the_image_default_is_auto(host):
    host.no_peermem()
    driver(host, "580.95.05", open_modules=True)
    assert mooncake_sees(entrypoint(host)) == "0"  # PD_GPUDIRECT unset
    assert "ENV PD_PROTOCOL=rdma \\\n    PD_GPUDIRECT=auto\n" in (
        ROOT / "images/base/Dockerfile").read_text()


def test_an_explicit_mode_is_the_one_checked_and_told(host):
    driver(host, "580.95.05", open_modules=True)  # both paths usable
    assert mooncake_sees(entrypoint(host, PD_GPUDIRECT="dmabuf")) == "0"
    assert mooncake_sees(entrypoint(host, PD_GPUDIRECT="peermem")) == "1"


def test_explicit_dmabuf_on_a_proprietary_module_host_fails(host):
    res = entrypoint(host, PD_GPUDIRECT="dmabuf")  # nvidia_peermem loaded, closed modules
    assert "DMA-BUF is not usable (it needs NVIDIA's open kernel modules" in one_error(res)
    assert "WITH_NVIDIA_PEERMEM" not in res.stdout


def test_auto_with_neither_path_fails_naming_both(host):
    host.no_peermem()
    msg = one_error(entrypoint(host))
    assert "nvidia_peermem is not loaded on the host and DMA-BUF is not usable" in msg
    assert "modprobe nvidia_peermem" in msg and "open kernel modules" in msg


def test_a_users_with_nvidia_peermem_is_kept(host):
    host.no_peermem()
    driver(host, "580.95.05", open_modules=True)
    res = entrypoint(host, WITH_NVIDIA_PEERMEM="1")
    assert mooncake_sees(res) == "1"
    assert ("pd-entrypoint: WITH_NVIDIA_PEERMEM=1 set by the user, kept (the preflight "
            "checked GPUDirect dmabuf)") in res.stdout


def test_tcp_leaves_gpudirect_alone(host):
    host.no_peermem()
    assert mooncake_sees(entrypoint(host, PD_PROTOCOL="tcp", PD_GPUDIRECT="bogus")) == "unset"


def test_without_the_preflight_an_explicit_mode_still_reaches_mooncake(host):
    host.no_peermem()
    off = {"PD_PREFLIGHT": "0"}
    assert mooncake_sees(entrypoint(host, PD_GPUDIRECT="dmabuf", **off)) == "0"
    assert mooncake_sees(entrypoint(host, PD_GPUDIRECT="auto", **off)) == "unset"
    assert mooncake_sees(entrypoint(host, PD_GPUDIRECT="peermem", PD_PROTOCOL="tcp",
                                    **off)) == "unset"


def test_each_nic_of_a_list_is_checked(tmp_path):
    host = FakeHost(tmp_path / "root", devices=("mlx5_0", "mlx5_2")).build()
    res = preflight(host, PD_RDMA_DEVICE="mlx5_0,mlx5_2")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("pd-preflight: ok: mlx5_0 port 1 ACTIVE (200 Gb/sec (4X HDR)), "
                                 "mlx5_2 port 1 ACTIVE (200 Gb/sec (4X HDR)), uverbs0, ")
    host.port_down("mlx5_2")
    assert "RDMA device mlx5_2 has no ACTIVE port" in one_error(
        preflight(host, PD_RDMA_DEVICE="mlx5_0,mlx5_2"))
    assert "RDMA device mlx5_9 not found (visible: mlx5_0 mlx5_2)" in one_error(
        preflight(host, PD_RDMA_DEVICE="mlx5_0,mlx5_9"))


# ---- the NVIDIA driver (GPU image only) --------------------------------------------------

OLD = (f"pd-preflight: error: NVIDIA driver 550.54.15 is too old: this GPU image (CUDA 13) "
       f"needs {NEED} or later; install the R580 driver or newer on the host (its open kernel "
       f"modules also give DMA-BUF) and reboot")


@pytest.mark.parametrize("protocol", ["rdma", "tcp"])
def test_an_old_driver_stops_the_gpu_image_whatever_the_protocol(host, protocol):
    driver(host, "550.54.15")  # CUDA 12's
    res = entrypoint(host, PD_PROTOCOL=protocol, PD_MIN_DRIVER=NEED)
    assert one_error(res) == OLD
    assert "WITH_NVIDIA_PEERMEM" not in res.stdout  # the command never ran


def test_the_entrypoint_logs_what_the_preflight_found_before_it_failed(host):
    driver(host, "580.95.05")
    host.port_down()
    res = entrypoint(host, PD_MIN_DRIVER=NEED)
    assert "mlx5_0 has no ACTIVE port" in one_error(res)
    assert res.stdout == f"pd-preflight: ok: NVIDIA driver 580.95.05 ({NEED} or later)\n"


@pytest.mark.parametrize(("version", "ok"), [
    ("580.65.06", True), ("580.95.05", True), ("590.44.01", True), ("1000.1", True),
    ("580.65.5", False), ("575.57.08", False), ("570.172.08", False)])
def test_versions_compare_by_number(host, version, ok):
    driver(host, version)
    res = preflight(host, PD_PROTOCOL="tcp", PD_MIN_DRIVER=NEED)
    if ok:
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [
            f"pd-preflight: ok: NVIDIA driver {version} ({NEED} or later)",
            "pd-preflight: protocol tcp: no RDMA checks"]
    else:
        assert f"NVIDIA driver {version} is too old" in one_error(res)


def test_nvidia_smi_answers_where_proc_does_not(host, tmp_path):
    (host.root / "proc/driver/nvidia/version").unlink()
    smi = tmp_path / "nvidia-smi"
    for version, ok in (("550.54.15", False), ("580.82.07", True)):
        smi.write_text('#!/bin/sh\n[ "$*" = "--query-gpu=driver_version --format=csv,noheader" ]'
                       f' || exit 9\nprintf "{version}\\n{version}\\n"\n')
        smi.chmod(0o755)
        res = preflight(host, PD_PROTOCOL="tcp", PD_MIN_DRIVER=NEED, PD_NVIDIA_SMI=str(smi))
        assert (res.returncode == 0) is ok, res.stderr
        assert version in (res.stdout if ok else res.stderr)


def test_no_driver_on_the_gpu_image_says_what_to_install(host):
    host.cpu_only(FakeRunner())
    msg = one_error(preflight(host, PD_PROTOCOL="tcp", PD_MIN_DRIVER=NEED))
    assert msg.startswith("pd-preflight: error: no NVIDIA driver found")
    assert f"needs NVIDIA driver {NEED} or later; install the R580 driver" in msg
    assert "NVIDIA runtime" in msg and "--stack cpu" in msg


def test_the_cpu_stack_checks_no_driver(host):
    """PD_MIN_DRIVER comes from the GPU vLLM image alone: the base Dockerfile builds the CPU
    base too, and a CPU host has no driver."""
    host.cpu_only(FakeRunner())
    res = preflight(host, PD_PROTOCOL="tcp")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "pd-preflight: protocol tcp: no RDMA checks"
    setting = re.compile(r"^\s*(ENV\s+)?PD_MIN_DRIVER=", re.M)
    gpu = (ROOT / "images/vllm/Dockerfile").read_text()
    assert re.search(rf"^\s*(ENV\s+)?PD_MIN_DRIVER={re.escape(NEED)}\b", gpu, re.M)
    for name in ("base", "vllm-cpu", "slim"):
        assert not setting.search((ROOT / f"images/{name}/Dockerfile").read_text()), name
