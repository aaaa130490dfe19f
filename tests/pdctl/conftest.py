"""Fixtures for pdctl: a fake healthy GPU+RDMA host and a CLI runner bound to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from appliance.pdctl.cli import cli
from tests.pdctl.fakes import FakeHost, FakeRunner, env_for, healthy_runner

GOOD_TOML = """\
[host]
name = "node1"
ip = "10.0.0.11"

[model]
path = "/models/qwen"

[gpus]
prefill = [0]
decode = [1]

[transfer]
protocol = "rdma"
device = "mlx5_0"
"""


@pytest.fixture
def host(tmp_path) -> FakeHost:
    return FakeHost(tmp_path / "root").build()


@pytest.fixture
def runner() -> FakeRunner:
    return healthy_runner()


Invoke = Callable[..., Result]


@pytest.fixture
def pdctl(host, runner) -> Invoke:
    """pdctl(*args) on the fake host; returns click's Result (stdout, stderr, exit_code)."""
    def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), obj=env_for(host.root, runner), env=env)
    return invoke


@pytest.fixture
def write_config(tmp_path) -> Callable[[str], Path]:
    def write(text: str, name: str = "host.toml") -> Path:
        path = tmp_path / "etc" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path
    return write


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]
