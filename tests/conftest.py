"""Shared fixtures: the repository root, the venv's python, free ports."""

from __future__ import annotations

import itertools
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Ports handed out come from below the kernel's ephemeral range (32768-60999 by default),
# so no outgoing connection of a server under test takes one between the test picking it
# and the server binding it; never the same one twice in a run, and 8 apart, as servers
# given a base port (data-parallel ranks, a host's second D) also take the next few.
_PORTS = range(20000, 32000, 8)
_order = itertools.islice(itertools.cycle(_PORTS), (os.getpid() * 7919) % len(_PORTS), None)


def free_port() -> int:
    for port in itertools.islice(_order, len(_PORTS)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def python_exe() -> str:
    return sys.executable


# --- real vLLM servers of the tiny model ------------------------------------------------

MODEL_CACHE = ROOT / ".cache" / "models"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model, built once per checkout (the build is deterministic and cached)."""
    from appliance import tinymodel

    return tinymodel.build(MODEL_CACHE / "tiny", "tiny")


@contextmanager
def running_plain_server(model: Path, served_name: str, log_dir: Path,
                         extra: tuple[str, ...] = ()) -> Iterator[str]:
    """One plain vLLM server (no connector) of a model on core 0: the parity reference."""
    from appliance import kvbudget
    from appliance.process import (
        CPU_BLOCK_SIZE,
        CPU_EAGER,
        ServiceProcess,
        cpu_env,
        kv_cache_flags,
        vllm_serve_argv,
    )

    port = free_port()
    kv_bytes = kvbudget.budget(None, model, 2048, CPU_BLOCK_SIZE)
    proc = ServiceProcess(
        f"plain-{served_name}",
        vllm_serve_argv(model, port, served_model_name=served_name, block_size=CPU_BLOCK_SIZE,
                        max_model_len=2048,
                        extra=(*CPU_EAGER, *kv_cache_flags(kv_bytes), *extra)),
        log_dir / "vllm.log", env=cpu_env("0"), health_url=f"http://127.0.0.1:{port}/health",
        cpus=[0],
    )
    proc.start()
    try:
        proc.wait_healthy(300)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()
    # vLLM's IPC sockets went in the launcher's folder, removed when the server stopped.
    assert proc.proc is not None
    from appliance.launcher import RPC_DIR_PREFIX
    left = list(Path(tempfile.gettempdir()).glob(f"{RPC_DIR_PREFIX}{proc.proc.pid}-*"))
    assert not left, f"the stopped server left {left}"


@pytest.fixture(scope="session")
def plain_server(tiny_model, tmp_path_factory):
    """One plain vLLM server of the tiny model: the parity reference."""
    with running_plain_server(tiny_model, "tiny", tmp_path_factory.mktemp("plain")) as url:
        yield url
