"""`pdctl up` / `down` with docker compose (through the command runner), waiting for health
through the Docker Engine API."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from appliance.pdctl.cluster.compose import service_names
from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.errors import PdctlError
from appliance.pdctl.host.composebin import find_compose
from appliance.pdctl.node.dockerapi import ContainerState, DockerApi
from appliance.pdctl.node.logcause import error_excerpt
from appliance.pdctl.node.render import compose_argv
from appliance.pdctl.node.status import ProcessState
from appliance.pdctl.runner import Runner

PULL_AND_CREATE_TIMEOUT = 3600.0  # first start pulls multi-GB images


def compose_command(runner: Runner) -> tuple[str, ...]:
    """The engine's Compose plugin or the bundled Compose (appliance.pdctl.host.composebin)."""
    found, why = find_compose(runner)
    if found is None:
        raise PdctlError(f"docker compose: {why} (`pdctl doctor` checks)")
    return found.argv


def exec_compose(cfg: HostConfig, out_dir: Path, runner: Runner, args: list[str]) -> None:
    """Replace this process with Compose on the rendered directory (output, exit code and
    signals are Compose's own)."""
    argv = compose_argv(cfg, out_dir, compose_command(runner))
    try:
        os.execvp(argv[0], [*argv, *args])
    except OSError as exc:
        raise PdctlError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None


def _run_compose(cfg: HostConfig, out_dir: Path, runner: Runner, args: list[str],
                 what: str) -> None:
    argv = compose_argv(cfg, out_dir, compose_command(runner))
    res = runner.run([*argv, *args], timeout=PULL_AND_CREATE_TIMEOUT)
    if res.missing:
        raise PdctlError(f"{argv[0]} not found (install Docker Engine; `pdctl doctor` checks)")
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


def failing(c: ContainerState, restarts_before: int) -> bool:
    """Dead, restarting, unhealthy, or restarted since `pdctl up` began: a server whose
    engine died exits, and its restart policy brings it back to fail the same way, so
    waiting longer shows nothing new."""
    return (c.state in ("exited", "dead", "restarting") or c.health == "unhealthy"
            or c.restarts > restarts_before)


def failure(api: DockerApi, project: str, c: ContainerState) -> PdctlError:
    """One line for what happened, and the cause from the container's own log."""
    if c.state == "running":  # Docker resets the exit code at each start: not known here
        what = "unhealthy" if c.health == "unhealthy" else "exited and was restarted"
    else:
        what = c.state
    facts = [f"exit code {c.exit_code}"] if c.exit_code else []
    if c.restarts:
        facts.append(f"restarted {c.restarts} time{'s' if c.restarts != 1 else ''}")
    said = f" ({', '.join(facts)})" if facts else ""
    line = f"{c.service} failed: {what}{said}; see `pdctl logs {c.service}`"
    return PdctlError(line, detail="\n".join(f"  {c.service}: {x}"
                                             for x in container_cause(api, project, c.service)))


def container_cause(api: DockerApi, project: str, service: str) -> list[str]:
    """The error lines of a container's last log lines ([] when the log cannot be read)."""
    try:
        text = b"".join(api.logs(project, service, tail=400)).decode(errors="replace")
    except PdctlError:
        return []
    return error_excerpt(text)


def container_states(api: DockerApi, project: str,
                     names: tuple[str, ...]) -> dict[str, ProcessState]:
    """Each service's container as `pdctl status` shows it, with the cause when it is down."""
    containers = api.project(project)
    out = {}
    for name in names:
        c = containers.get(name)
        out[name] = ProcessState("missing", False) if c is None else ProcessState(
            c.state, c.ok, c.health or "", c.restarts, c.exit_code,
            () if c.ok else tuple(container_cause(api, project, name)))
    return out


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
    baseline: dict[str, int] = {}  # restarts when first seen: a restart during up is a failure
    with Live(_table(states, 0, names), console=console, refresh_per_second=2,
              transient=True) as live:
        while True:
            states = api.project(project)
            elapsed = time.monotonic() - begin
            for name in names:
                if name not in timings and name in states and states[name].ok:
                    timings[name] = elapsed
            live.update(_table(states, elapsed, names))
            # compose up fails too when a dependency dies ("dependency failed to start"):
            # a failing container's own cause comes first, compose's error only without one.
            error = failed()
            if error is None and all(name in states and states[name].ok for name in names):
                console.print(_table(states, elapsed, names))
                return states
            for name in names:
                c = states.get(name)
                if c is not None and failing(c, baseline.setdefault(name, c.restarts)):
                    console.print(_table(states, elapsed, names))
                    raise failure(api, project, c)
            if error is not None:
                raise error
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
