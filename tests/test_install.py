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


FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for the venv's python: pip records its arguments and, like a pip whose
# configuration knows no index with torch's CPU build, cannot find it unless given one.
echo "$*" >> "$CALLS"
if [[ "$1 $2 $3" == "-m pip install" ]]; then
  if [[ "$*" == *"--extra-index-url"* ]]; then exit 0; fi
  if [[ -n "${OTHER_FAILURE:-}" ]]; then
    echo "ERROR: Could not install packages due to an OSError: [Errno 28] No space left" >&2
    exit 1
  fi
  echo "ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu" >&2
  echo "ERROR: No matching distribution found for torch==2.13.0+cpu" >&2
  exit 1
fi
cat >/dev/null  # the import check reads its script from stdin
exit 0
"""


def _run_torch_step(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """install.sh --cpu into a venv whose python is FAKE_PYTHON."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls"
    base = {k: v for k, v in os.environ.items() if k != "PD_TORCH_INDEX_URL"}
    res = subprocess.run(["bash", str(INSTALL), "--cpu", "--venv", str(venv)],
                         capture_output=True, text=True, timeout=120,
                         env={**base, "CALLS": str(calls), **env})
    installs = [line for line in calls.read_text().splitlines()
                if line.startswith("-m pip install")] if calls.exists() else []
    return res, installs


def test_cpu_torch_falls_back_to_pytorchs_index(tmp_path):
    res, installs = _run_torch_step(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(installs) == 2
    assert "--extra-index-url" not in installs[0]  # pip's own configuration first
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in installs[1]
    said = [line for line in res.stdout.splitlines() if "PyTorch's CPU wheel index" in line]
    assert len(said) == 1 and "PD_TORCH_INDEX_URL" in said[0]


def test_torch_index_from_the_environment_wins(tmp_path):
    res, installs = _run_torch_step(tmp_path, PD_TORCH_INDEX_URL="http://127.0.0.1:9/whl")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(installs) == 1 and "--extra-index-url http://127.0.0.1:9/whl" in installs[0]
    assert "PyTorch's CPU wheel index" not in res.stdout


def test_other_pip_failures_are_not_retried(tmp_path):
    res, installs = _run_torch_step(tmp_path, OTHER_FAILURE="1")
    assert res.returncode != 0 and len(installs) == 1
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("install.sh: error: pip install failed: ERROR: Could not install")
