"""The unit's preflight as systemd runs it: ExecStartPre's `pdctl doctor` on a healthy GPU
host. A service gets systemd's memlock (8 MiB by default; limits.conf is PAM's, which a unit
never reads), and that must not stop the node: the engines' limit comes from compose."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.pdctl.cli import cli
from appliance.pdctl.config.hostconfig import load_config
from appliance.pdctl.node.render import PDCTL_BIN, unit_text
from tests.conftest import ROOT
from tests.pdctl.conftest import GOOD_TOML
from tests.pdctl.fakes import FakeHost, FakeRunner, env_for

# The subprocess's pdctl on the fake host: its own /proc/self/limits is the real one.
CHILD = """\
import sys
from pathlib import Path
from appliance.pdctl.cli import cli
from tests.pdctl.fakes import env_for, healthy_runner
print(next(l for l in open("/proc/self/limits") if l.startswith("Max locked")), file=sys.stderr)
cli.main(args=sys.argv[2:], prog_name="pdctl", obj=env_for(Path(sys.argv[1]), healthy_runner()))
"""


def _preflight(tmp_path: Path) -> list[str]:
    """The unit's ExecStartPre, rendered for a config in tmp_path, as argv."""
    path = tmp_path / "etc" / "host.toml"
    path.parent.mkdir(parents=True)
    path.write_text(GOOD_TOML)
    unit = unit_text(load_config(path), path.parent, path)
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStartPre="))
    argv = shlex.split(line.split("=", 1)[1])
    assert argv[:2] == [PDCTL_BIN, "doctor"]
    return argv


def _memlock_row(output: str) -> str:
    m = re.search(r"memlock\s*│\s*(\w+)", output)
    assert m, output
    return m.group(1)


def test_unit_preflight_passes_with_a_services_memlock(tmp_path, host: FakeHost,
                                                       runner: FakeRunner):
    host.low_memlock()  # what the unit's process has: 8 MiB soft and hard
    argv = _preflight(tmp_path)
    res = CliRunner().invoke(cli, argv[1:], obj=env_for(host.root, runner))
    assert res.exit_code == 0, res.output
    assert _memlock_row(res.output) == "pass"


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="prlimit (util-linux) missing")
def test_unit_preflight_in_a_process_with_finite_memlock(tmp_path, host: FakeHost):
    limits = host.root / "proc/self/limits"
    limits.unlink()
    limits.symlink_to("/proc/self/limits")  # the child reads its own, real limits
    argv = _preflight(tmp_path)
    res = subprocess.run(["prlimit", "--memlock=65536:65536", sys.executable, "-c", CHILD,
                          str(host.root), *argv[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert re.search(r"Max locked memory\s+65536\s+65536", res.stderr), res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert _memlock_row(res.stdout) == "pass"


def test_unit_preflight_fails_on_a_rootless_engine_that_cannot_grant_it(tmp_path,
                                                                       host: FakeHost,
                                                                       runner: FakeRunner):
    host.low_memlock()
    host.rootless_dockerd()
    argv = _preflight(tmp_path)
    res = CliRunner().invoke(cli, argv[1:], obj=env_for(host.root, runner),
                             env={"COLUMNS": "300"})
    assert res.exit_code == 1
    assert _memlock_row(res.output) == "fail"
    assert "LimitMEMLOCK=infinity" in res.output
