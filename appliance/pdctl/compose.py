"""`pdctl up` / `down` with docker compose (through the command runner), waiting for health
through the Docker Engine API."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from appliance.pdctl.clustercompose import service_names
from appliance.pdctl.config import HostConfig
from appliance.pdctl.dockerapi import ContainerState, DockerApi
from appliance.pdctl.errors import PdctlError
from appliance.pdctl.render import compose_argv
from appliance.pdctl.runner import Runner

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


def _table(states: dict[str, ContainerState], elapsed: float, names: tuple[str, ...]) -> Table:
    table = Table(title=f"waiting for the node to be healthy ({elapsed:.0f} s)",
                  title_justify="left")
    for col in ("service", "container", "state", "health", "restarts"):
        table.add_column(col)
    for name in names:
        c = states.get(name)
        if c is None:
            table.add_row(name, "-", "not created", "-", "-")
        else:
            table.add_row(name, c.name, c.state, c.health or "-", str(c.restarts))
    return table


def wait_healthy(api: DockerApi, project: str, timeout: float, console: Console,
                 names: tuple[str, ...], poll: float = 2.0, begin: float | None = None,
                 timings: dict[str, float] | None = None,
                 failed: Callable[[], BaseException | None] = lambda: None,
                 ) -> dict[str, ContainerState]:
    """Poll until every service's container is healthy; `timings` gets each service's
    seconds from `begin` to its first healthy poll. `failed()` names an error of the
    `compose up` running meanwhile, which ends the wait."""
    begin = time.monotonic() if begin is None else begin
    timings = {} if timings is None else timings
    states: dict[str, ContainerState] = {}
    with Live(_table(states, 0, names), console=console, refresh_per_second=2,
              transient=True) as live:
        while True:
            states = api.project(project)
            elapsed = time.monotonic() - begin
            for name in names:
                if name not in timings and name in states and states[name].ok:
                    timings[name] = elapsed
            live.update(_table(states, elapsed, names))
            error = failed()
            if error is not None:
                raise error
            if all(name in states and states[name].ok for name in names):
                console.print(_table(states, elapsed, names))
                return states
            for name, c in states.items():
                if c.state in ("exited", "dead") or c.health == "unhealthy":
                    console.print(_table(states, elapsed, names))
                    raise PdctlError(f"{name} is {c.health or c.state}"
                                     f"{f' (exit code {c.exit_code})' if c.exit_code else ''}; "
                                     f"see `pdctl logs {name}`")
            if elapsed > timeout:
                console.print(_table(states, elapsed, names))
                late = [n for n in names if n not in states or not states[n].ok]
                raise PdctlError(f"not healthy after {timeout:.0f} s: {', '.join(late)}; see "
                                 f"`pdctl logs {late[0]}`")
            time.sleep(poll)


def compose_up(cfg: HostConfig, out_dir: Path, runner: Runner, console: Console,
               wait: bool = True, timeout: float | None = None,
               poll: float = 2.0) -> dict[str, float]:
    """Seconds from the start of `up` to "created" (compose returned) and to each service's
    first healthy poll, and "total" ({} without waiting)."""
    begin = time.monotonic()
    console.print(f"pdctl: docker compose up ({out_dir})")
    argv = ["up", "--detach", "--remove-orphans"]
    if not wait:
        _run_compose(cfg, out_dir, runner, argv, "up")
        return {}
    # compose up itself waits for each depends_on health condition before it creates the
    # next service (the proxy last): run it beside the health poll, so each service's time
    # is its own.
    timings: dict[str, float] = {}
    errors: list[BaseException] = []

    def up() -> None:
        try:
            _run_compose(cfg, out_dir, runner, argv, "up")
            timings["created"] = time.monotonic() - begin
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            errors.append(exc)

    thread = threading.Thread(target=up, name="compose-up", daemon=True)
    thread.start()
    try:
        api = DockerApi.connect()
    except PdctlError:
        thread.join(PULL_AND_CREATE_TIMEOUT)  # compose's own error says more, when it has one
        if errors:
            raise errors[0] from None
        raise
    wait_healthy(api, cfg.compose.project, timeout or cfg.timeouts.startup_s, console,
                 service_names(cfg), poll, begin, timings,
                 failed=lambda: errors[0] if errors else None)
    thread.join(PULL_AND_CREATE_TIMEOUT)
    if errors:
        raise errors[0]
    timings["total"] = time.monotonic() - begin
    return timings


_NOTES = {"created": "docker compose up returned (every container created)",
          "bootstrap": "sidecar healthy", "prefill": "vLLM P healthy (weights loaded)",
          "decode": "vLLM D healthy", "proxy": "proxy healthy (P registered, D up)"}


def timings_table(timings: dict[str, float]) -> Table:
    table = Table(title=f"node healthy in {timings['total']:.1f} s", title_justify="left")
    table.add_column("step")
    table.add_column("after (s)", justify="right")
    table.add_column("what")
    for name, seconds in sorted(timings.items(), key=lambda kv: kv[1]):
        if name != "total":
            table.add_row(name, f"{seconds:.1f}", _NOTES.get(name, ""))
    return table


def compose_down(cfg: HostConfig, out_dir: Path, runner: Runner, console: Console) -> None:
    _run_compose(cfg, out_dir, runner, ["down"], "down")
    console.print(f"pdctl: stopped project {cfg.compose.project}")
