"""install.sh: idempotent, one-line failures, and a stack that imports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

INSTALL = ROOT / "install.sh"


def _freeze(python: str) -> str:
    return subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True,
                          text=True, check=True, timeout=120).stdout


def test_unknown_option_is_one_line_and_nonzero():
    res = subprocess.run(["bash", str(INSTALL), "--frobnicate"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode != 0
    assert res.stderr.strip() == "install.sh: error: unknown option '--frobnicate' (see --help)"


def test_stack_imports_in_this_environment():
    code = ("import vllm; from mooncake.engine import TransferEngine; "
            "import appliance; print(vllm.__version__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().startswith("0.32.0")


@pytest.mark.slow
def test_rerun_on_installed_venv_changes_nothing():
    venv = ROOT / ".venv"
    if not (venv / ".appliance-install-stamp").exists():
        pytest.skip("the suite is not running from install.sh's .venv")
    before = _freeze(str(venv / "bin" / "python"))
    res = subprocess.run(["bash", str(INSTALL), "--cpu", "--dev"], capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    assert "already up to date" in res.stdout
    assert _freeze(str(venv / "bin" / "python")) == before


@pytest.mark.slow
def test_fresh_venv_twice(tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    first = subprocess.run(["bash", str(INSTALL), "--cpu", "--venv", str(venv)],
                           capture_output=True, text=True, timeout=1800, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    python = str(venv / "bin" / "python")
    check = subprocess.run([python, "-c", "import vllm; from mooncake.engine import "
                            "TransferEngine; import appliance"], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    frozen = _freeze(python)
    assert "torchvision" not in frozen and "torchcodec" not in frozen
    second = subprocess.run(["bash", str(INSTALL), "--cpu", "--venv", str(venv)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert second.returncode == 0 and "already up to date" in second.stdout
    assert _freeze(python) == frozen
