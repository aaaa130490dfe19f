"""`pdctl doctor` against fake host trees and fake command output."""

from __future__ import annotations

import json

import pytest

from tests.pdctl.conftest import GOOD_TOML


@pytest.fixture
def doctor(pdctl, write_config):
    def run(toml: str = GOOD_TOML) -> tuple[int, dict[str, dict]]:
        res = pdctl("doctor", "--config", str(write_config(toml)), "--json")
        assert "Traceback" not in res.output
        body = json.loads(res.stdout)
        return res.exit_code, {c["name"]: c for c in body["checks"]}
    return run


def failed(checks: dict[str, dict]) -> list[str]:
    return [name for name, c in checks.items() if c["status"] == "fail"]


def test_healthy_host_passes_everything(doctor):
    code, checks = doctor()
    assert code == 0 and failed(checks) == []
    assert checks["GPUs"]["detail"].startswith("2 × NVIDIA H100 80GB HBM3 (from nvidia-smi)")
    assert checks["RDMA port"]["detail"] == "mlx5_0 port 1 ACTIVE, 200 Gb/sec (4X HDR)"
    assert checks["GPUDirect RDMA"]["detail"] == "nvidia_peermem loaded"
    assert checks["NVIDIA driver"]["detail"] == "580.95.05 (from nvidia-smi; CUDA 13.0 needs " \
                                                "580.65.06)"
    assert checks["memlock"]["status"] == "pass"
    assert "dockerd (pid 812) runs as root and grants it" in checks["memlock"]["detail"]
    assert checks["/dev/infiniband"]["detail"] == "rdma_cm, uverbs0"
    assert checks["NVIDIA container runtime"]["status"] == "pass"


def test_table_output_and_exit_code(pdctl, write_config, host):
    host.no_peermem()
    res = pdctl("doctor", "--config", str(write_config(GOOD_TOML)))
    assert res.exit_code == 1
    assert "GPUDirect RDMA" in res.stdout and "fail" in res.stdout
    assert "fix: modprobe nvidia_peermem" in res.stdout
    assert "1 failed" in res.stdout


def test_no_peermem(doctor, host):
    host.no_peermem()
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["GPUDirect RDMA"]
    check = checks["GPUDirect RDMA"]
    assert "nvidia_peermem is not loaded" in check["detail"] and "Bad address" in check["detail"]
    assert check["fix"].startswith("modprobe nvidia_peermem")
    assert "/etc/modules-load.d/nvidia-peermem.conf" in check["fix"]
    # auto (the default) would take DMA-BUF too: the fix names what that needs
    assert "for DMA-BUF, NVIDIA's open kernel modules (the NVIDIA driver is the proprietary" \
        in check["fix"]


def test_no_peermem_but_dmabuf_usable(doctor, host):
    host.no_peermem()
    host.open_kernel_modules()
    code, checks = doctor(GOOD_TOML + 'gpudirect = "peermem"\n')
    assert code == 1 and 'set transfer.gpudirect = "dmabuf"' in checks["GPUDirect RDMA"]["fix"]
    for mode in ("dmabuf", "auto"):  # auto: the preflight takes the one that works
        code, checks = doctor(GOOD_TOML + f'gpudirect = "{mode}"\n')
        assert code == 0
        assert checks["GPUDirect RDMA"]["detail"].startswith("DMA-BUF usable (open kernel")


def test_dmabuf_needs_open_modules(doctor):
    code, checks = doctor(GOOD_TOML + 'gpudirect = "dmabuf"\n')
    assert code == 1
    assert "proprietary kernel module" in checks["GPUDirect RDMA"]["detail"]


def test_port_down(doctor, host):
    host.port_down()
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["RDMA port"]
    assert checks["RDMA port"]["detail"] == "mlx5_0: port 1 DOWN"
    assert "ibstat mlx5_0" in checks["RDMA port"]["fix"]


def test_no_dev_infiniband(doctor, host):
    host.no_dev_infiniband()
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["/dev/infiniband"]
    assert checks["/dev/infiniband"]["detail"] == "missing"
    assert "ib_uverbs" in checks["/dev/infiniband"]["fix"]


def test_old_driver_fails_naming_found_and_needed(doctor, host, runner):
    host.old_driver(runner)
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["NVIDIA driver"]
    check = checks["NVIDIA driver"]
    assert check["detail"] == "550.54.15 (from nvidia-smi): the images' CUDA 13.0 needs " \
                              "580.65.06 or later"
    assert "branch 580 or later" in check["fix"] and "nvidia-driver-580" in check["fix"]


def test_driver_version_from_proc_without_nvidia_smi(doctor, host, runner):
    for key in [k for k in runner.answers if k[0] == "nvidia-smi"]:
        runner.answers.pop(key)
    code, checks = doctor()
    assert checks["NVIDIA driver"]["detail"].startswith("580.95.05 (from /proc/driver/nvidia")
    host.old_driver(version="575.57.08")
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["NVIDIA driver"]
    assert checks["NVIDIA driver"]["detail"].startswith("575.57.08 (from /proc/driver/nvidia")


def test_pdctls_own_memlock_does_not_matter(doctor, host):
    """The engines run in containers that compose gives unlimited memlock; pdctl (as a
    systemd unit, or run from a login shell) may have the default 8 MiB."""
    host.low_memlock()
    code, checks = doctor()
    assert code == 0 and checks["memlock"]["status"] == "pass"


def test_rootless_dockerd_with_finite_hard_memlock(doctor, host):
    host.rootless_dockerd()
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["memlock"]
    check = checks["memlock"]
    assert "rootless dockerd (pid 2345, uid 1000) cannot raise its hard memlock (8192 KiB)" \
        in check["detail"]
    assert "LimitMEMLOCK=infinity" in check["fix"] and "systemctl --user" in check["fix"]


def test_rootless_dockerd_with_unlimited_hard_memlock(doctor, host):
    host.rootless_dockerd(hard_memlock_unlimited=True)
    code, checks = doctor()
    assert code == 0
    assert "rootless dockerd (pid 2345, uid 1000) has an unlimited hard memlock" in \
        checks["memlock"]["detail"]


def test_no_dockerd_skips_memlock(doctor, host):
    import shutil

    shutil.rmtree(host.root / "proc/812")
    code, checks = doctor()
    assert checks["memlock"]["status"] == "skip" and "no dockerd" in checks["memlock"]["detail"]


def test_port_in_use(doctor, host):
    host.listening(8020, 22)
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["ports"]
    assert checks["ports"]["detail"] == "in use: 8020 (decode)"


def test_fix_texts_print_as_written(pdctl, write_config, host):
    """rich reads "[ports]" as markup and drops it unless it is escaped."""
    host.listening(8020)
    res = pdctl("doctor", "--config", str(write_config(GOOD_TOML)), env={"COLUMNS": "300"})
    assert res.exit_code == 1
    assert "change [ports] in the host config" in " ".join(res.output.split())


def test_port_in_use_ipv6(doctor, host):
    from tests.pdctl.fakes import TCP_HEADER, tcp_listen_line

    (host.root / "proc/net/tcp6").write_text(TCP_HEADER + tcp_listen_line(8998).replace(
        "00000000:", "00000000000000000000000000000000:", 1))
    code, checks = doctor()
    assert checks["ports"]["detail"] == "in use: 8998 (bootstrap)"


def test_skip_option(pdctl, write_config, host):
    host.listening(8000)
    res = pdctl("doctor", "--config", str(write_config(GOOD_TOML)), "--skip", "ports")
    assert res.exit_code == 0, res.stdout


def test_missing_gpu_index_and_device(doctor):
    text = GOOD_TOML.replace("decode = [1]", "decode = [3]").replace('"mlx5_0"', '"mlx5_4"')
    code, checks = doctor(text)
    assert code == 1 and failed(checks) == ["GPU indices", "RDMA device"]
    assert checks["GPU indices"]["detail"] == "GPU 3 (gpus.decode) does not exist; this host " \
                                              "has GPUs 0, 1"
    assert checks["RDMA device"]["detail"] == "mlx5_4 not found (this host has: mlx5_0)"
    assert checks["RDMA port"]["status"] == "skip"


def test_tcp_host_skips_rdma_checks(doctor, host):
    host.no_peermem()
    host.no_dev_infiniband()
    host.rootless_dockerd()
    code, checks = doctor(GOOD_TOML.replace('"rdma"', '"tcp"'))
    assert code == 0
    for name in ("RDMA device", "RDMA port", "/dev/infiniband", "GPUDirect RDMA", "memlock",
                 "NICs (prefill)", "NICs (decode)", "PCIe ACS"):
        assert checks[name]["status"] == "skip", name


def test_no_docker(doctor, runner):
    for key in [k for k in runner.answers if k[0] == "docker"]:
        runner.answers.pop(key)
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["docker"]
    assert checks["docker compose"]["status"] == "skip"
    assert checks["NVIDIA container runtime"]["status"] == "skip"


def test_docker_daemon_down_and_no_nvidia_runtime(doctor, runner):
    runner.answer(["docker", "version"], "", 1,
                  "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the "
                  "docker daemon running?\n")
    code, checks = doctor()
    assert "daemon not reachable: Cannot connect" in checks["docker"]["detail"]
    assert checks["NVIDIA container runtime"]["status"] == "skip"
    runner.answer(["docker", "version"], "28.2.2\n")
    runner.answer(["docker", "info"], '{"runc":{}}\n')
    code, checks = doctor()
    assert code == 1 and failed(checks) == ["NVIDIA container runtime"]
    assert "nvidia-ctk runtime configure" in checks["NVIDIA container runtime"]["fix"]


def test_no_gpus(doctor, host, runner):
    import shutil

    runner.answers.pop(("nvidia-smi",))
    shutil.rmtree(host.root / "proc/driver/nvidia/gpus")
    code, checks = doctor()
    assert failed(checks) == ["GPUs"] and checks["GPU indices"]["status"] == "skip"


def test_doctor_without_a_config_runs_generic_checks(pdctl, tmp_path):
    res = pdctl("doctor", "--json", env={"PDCTL_CONFIG": str(tmp_path / "none.toml")})
    body = json.loads(res.stdout)
    assert res.exit_code == 0 and body["config"] is None
    checks = {c["name"]: c for c in body["checks"]}
    assert checks["RDMA device"]["detail"].startswith("mlx5_0")
    assert checks["model"]["status"] == "skip"
