"""The launcher's private folder for vLLM's IPC sockets (appliance.launcher)."""

from __future__ import annotations

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
