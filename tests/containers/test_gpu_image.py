"""The GPU stack's images, built here as a host without NVIDIA's registry builds them.

On the container tests' private engine (conftest.py) and Debian base: images/build.sh
--stack gpu with CUDA_BASE_IMAGE the local Debian bookworm, so the CUDA libraries come from
the torch and nvidia-* wheels vLLM pulls in. The vLLM image's build runs pd-gpu-stack-check
(every shared library resolvable but the driver's, the imports, the CUDA 13 build, Triton's
compiler, no FlashInfer JIT on an H100's default attention backend); here it runs again in a
container, the image's environment is what the NVIDIA container runtime reads, and the
entrypoint's preflight stops the container without a driver and passes on a healthy host
tree. No GPU is used. Build timings and the image's size are printed and appended to
<cache>/gpu-image-timings.jsonl.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.containers.engine import GPU_TAG, build_gpu_images, cache_dir
from tests.pdctl.fakes import DRIVER, FakeHost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(4800)]

VLLM = f"pd-appliance/vllm:{GPU_TAG}"
INSTALL_STEP = "RUN python3 -m venv /opt/venv"


@pytest.fixture(scope="module")
def gpu_image(docker_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("gpu-build") / "build.log"
    had_image = docker_engine.docker("image", "inspect", VLLM).returncode == 0
    times = build_gpu_images(docker_engine, log)
    text = log.read_text(errors="replace")
    # The legacy builder prints " ---> Using cache" under each step it did not run.
    install = text[text.find(INSTALL_STEP):]
    cold = INSTALL_STEP in text and not re.match(r"[^\n]*\n ---> Using cache", install)
    size = int(docker_engine.docker("image", "inspect", "-f", "{{.Size}}", VLLM).stdout)
    # A new freeze leaves the last vLLM image's layers (about 9 GB) untagged: reclaim them,
    # so the cache holds one GPU stack.
    docker_engine.docker("image", "prune", "-f", timeout=600)
    record = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cold": cold,
              "image_existed": had_image, "base_s": round(times["base"], 1),
              "images_s": round(times["images"], 1), "vllm_image_bytes": size}
    with (cache_dir() / "gpu-image-timings.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")
    print(f"\nGPU images: {'cold' if cold else 'warm'} build {times['images']:.0f} s "
          f"(Debian base {times['base']:.0f} s), {VLLM} {size / 1e9:.1f} GB")
    return {"engine": docker_engine, "log": text, "cold": cold}


def run(gpu_image, *args: str, timeout: float = 600):
    return gpu_image["engine"].docker("run", "--rm", "--network", "host", *args,
                                      timeout=timeout)


def image_env(engine, image: str) -> dict[str, str]:
    res = engine.docker("image", "inspect", "-f", "{{json .Config.Env}}", image)
    assert res.returncode == 0, res.stderr
    return dict(item.split("=", 1) for item in json.loads(res.stdout))


def test_the_gpu_stack_builds_on_a_debian_base(gpu_image):
    engine = gpu_image["engine"]
    for name in ("base", "vllm", "slim"):
        assert engine.docker("image", "inspect", f"pd-appliance/{name}:{GPU_TAG}").returncode == 0
    res = run(gpu_image, "--entrypoint", "sh", VLLM, "-c",
              ". /etc/os-release; echo $ID $VERSION_CODENAME; command -v nvcc || echo no-nvcc")
    assert res.stdout.split() == ["debian", "bookworm", "no-nvcc"], res.stdout + res.stderr
    if gpu_image["cold"]:  # the check ran in this build: its summary is in the log
        assert "pd-gpu-stack-check: ok: " in gpu_image["log"]


def test_the_image_proves_what_vllm_triton_flashinfer_and_mooncake_need(gpu_image):
    res = run(gpu_image, "--entrypoint", "pd-gpu-stack-check", VLLM, "/opt/venv/bin/python")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = res.stdout.strip().splitlines()[-1]
    print(f"\n{summary}")
    assert summary.startswith("pd-gpu-stack-check: ok: "), summary
    assert re.search(r"need only the driver's libcuda\.so\.1( libnvidia-ml\.so\.1)?\)", summary)
    assert re.search(r"torch 2\.13\.0\S* \(CUDA 13\.\d+\), vllm 0\.32\.0", summary), summary
    assert "cc + Python.h" in summary
    assert "H100 attention FLASH_ATTN (_vllm_fa3_C" in summary
    assert "FlashInfer sampler off, nvcc none on PATH" in summary
    assert "mooncake engine import needs the driver (libcuda.so.1)" in summary


def test_the_image_asks_the_nvidia_runtime_as_nvidias_cuda_images_do(gpu_image):
    engine = gpu_image["engine"]
    env = image_env(engine, VLLM)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["NVIDIA_REQUIRE_CUDA"] == "cuda>=13.0"
    assert env["PD_MIN_DRIVER"] == "580.65.06"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["PATH"].startswith("/opt/venv/bin:/usr/local/nvidia/bin:")
    entry = engine.docker("image", "inspect", "-f", "{{json .Config.Entrypoint}}", VLLM)
    assert json.loads(entry.stdout) == ["/usr/local/bin/pd-entrypoint"]
    # The base is shared with the CPU stack: NVIDIA's variables are the vLLM image's alone.
    for image in (f"pd-appliance/base:{GPU_TAG}", f"pd-appliance/base-cpu:{GPU_TAG}",
                  f"pd-appliance/vllm-cpu:{GPU_TAG}"):
        if engine.docker("image", "inspect", image).returncode == 0:
            assert not [k for k in image_env(engine, image) if k.startswith("NVIDIA_")], image


def test_without_a_driver_the_preflight_stops_the_container(gpu_image):
    res = run(gpu_image, VLLM, "true", timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(
        "pd-preflight: error: no NVIDIA driver found (no /proc/driver/nvidia/version, no "
        "nvidia-smi): this GPU image (CUDA 13) needs NVIDIA driver 580.65.06 or later"), res.stderr


def test_on_a_healthy_host_the_preflight_passes_and_tells_mooncake(gpu_image, tmp_path):
    host = FakeHost(tmp_path / "root").build()
    res = run(gpu_image, "-v", f"{host.root}:/fakehost:ro", "-e", "PD_PREFLIGHT_ROOT=/fakehost",
              VLLM, "env", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert f"pd-preflight: ok: NVIDIA driver {DRIVER} (580.65.06 or later)" in lines
    assert any(line.startswith("pd-preflight: ok: mlx5_0 port 1 ACTIVE") and
               line.endswith("GPUDirect via nvidia_peermem") for line in lines), lines
    assert "pd-entrypoint: GPUDirect peermem: WITH_NVIDIA_PEERMEM=1" in lines
    assert "WITH_NVIDIA_PEERMEM=1" in lines
    # An older driver is refused by the same preflight, with the branch to install.
    host.old_driver()
    old = run(gpu_image, "-v", f"{host.root}:/fakehost:ro", "-e", "PD_PREFLIGHT_ROOT=/fakehost",
              VLLM, "env", timeout=120)
    assert old.returncode == 1 and "NVIDIA driver 550.54.15 is too old" in old.stderr
