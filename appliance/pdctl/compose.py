"""`pdctl up` / `down` with docker compose (through the command runner), waiting for health
through the Docker Engine API."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from appliance.pdctl.config import HostConfig
from appliance.pdctl.dockerapi import ContainerState, DockerApi
from appliance.pdctl.errors import PdctlError
from appliance.pdctl.render import compose_argv
from appliance.pdctl.runner import Runner
from appliance.pdctl.status import SERVICES

PULL_AND_CREATE_TIMEOUT = 3600.0  # first start pulls multi-GB images


def _run_compose(cfg: HostConfig, out_dir: Path, runner: Runner, args: list[str],
                 what: str) -> None:
    res = runner.run([*compose_argv(cfg, out_dir), *args], timeout=PULL_AND_CREATE_TIMEOUT)
    if res.missing:
        raise PdctlError("docker CLI not found (install Docker Engine and the compose plugin; "
                         "`pdctl doctor` checks)")
    if not res.ok:
        tail = "\n".join((res.stderr or res.stdout).splitlines()[-15:])
        raise PdctlError(f"docker compose {what} failed: {res.reason()}", detail=tail)


def _table(states: dict[str, ContainerState], elapsed: float) -> Table:
    table = Table(title=f"waiting for the node to be healthy ({elapsed:.0f} s)",
                  title_justify="left")
    for col in ("service", "container", "state", "health", "restarts"):
        table.add_column(col)
    for name in SERVICES:
        c = states.get(name)
        if c is None:
            table.add_row(name, "-", "not created", "-", "-")
        else:
            table.add_row(name, c.name, c.state, c.health or "-", str(c.restarts))
    return table


def wait_healthy(api: DockerApi, project: str, timeout: float, console: Console,
                 poll: float = 2.0) -> dict[str, ContainerState]:
    begin = time.monotonic()
    states: dict[str, ContainerState] = {}
    with Live(_table(states, 0), console=console, refresh_per_second=2,
              transient=False) as live:
        while True:
            states = api.project(project)
            elapsed = time.monotonic() - begin
            live.update(_table(states, elapsed))
            if all(name in states and states[name].ok for name in SERVICES):
                return states
            for name, c in states.items():
                if c.state in ("exited", "dead") or c.health == "unhealthy":
                    raise PdctlError(f"{name} is {c.health or c.state}"
                                     f"{f' (exit code {c.exit_code})' if c.exit_code else ''}; "
                                     f"see `pdctl logs {name}`")
            if elapsed > timeout:
                late = [n for n in SERVICES if n not in states or not states[n].ok]
                raise PdctlError(f"not healthy after {timeout:.0f} s: {', '.join(late)}; see "
                                 f"`pdctl logs {late[0]}`")
            time.sleep(poll)


def compose_up(cfg: HostConfig, out_dir: Path, runner: Runner, console: Console,
               wait: bool = True, timeout: float | None = None, poll: float = 2.0) -> float:
    """Returns seconds until healthy (0 without waiting)."""
    begin = time.monotonic()
    console.print(f"pdctl: docker compose up ({out_dir})")
    _run_compose(cfg, out_dir, runner, ["up", "--detach", "--remove-orphans"], "up")
    if not wait:
        return 0.0
    api = DockerApi.connect()
    wait_healthy(api, cfg.compose.project, timeout or cfg.timeouts.startup_s, console, poll)
    return time.monotonic() - begin


def compose_down(cfg: HostConfig, out_dir: Path, runner: Runner, console: Console) -> None:
    _run_compose(cfg, out_dir, runner, ["down"], "down")
    console.print(f"pdctl: stopped project {cfg.compose.project}")
