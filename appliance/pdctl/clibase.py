"""What every pdctl command shares: the host seams (root, runner, console), one-line errors
and exit codes, and how the host config is found and loaded."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from appliance.pdctl.config import hostconfig as cfgmod
from appliance.pdctl.config.hostconfig import HostConfig, load_config
from appliance.pdctl.errors import USAGE, ConfigError, PdctlError
from appliance.pdctl.host.check import host_problems
from appliance.pdctl.host.probe import HostProbe
from appliance.pdctl.runner import Runner, SubprocessRunner


@dataclass
class Env:
    """What every command reads the host through: tests pass a fake root and runner."""
    root: Path = Path("/")
    runner: Runner = field(default_factory=SubprocessRunner)
    console: Console | None = None

    @property
    def probe(self) -> HostProbe:
        return HostProbe(self.root, self.runner)

    @property
    def out(self) -> Console:
        if self.console is None:
            self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
        return self.console


def fail(lines: list[str] | str, code: int, detail: str = "") -> None:
    for line in [lines] if isinstance(lines, str) else lines:
        click.echo(f"pdctl: error: {line}", err=True)
    if detail:
        click.echo(detail.rstrip("\n"), err=True)
    sys.exit(code)


class PdctlGroup(click.Group):
    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        try:
            rv = super().main(args, prog_name or "pdctl", complete_var,
                              standalone_mode=False, **extra)
        except PdctlError as exc:
            fail(exc.lines, exc.code, exc.detail)
        except click.UsageError as exc:
            hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            fail(exc.format_message() + hint, USAGE)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            fail("interrupted", 130)
        sys.exit(rv if isinstance(rv, int) else 0)


def env_of(ctx: click.Context) -> Env:
    if not isinstance(ctx.obj, Env):
        ctx.obj = Env()
    return ctx.obj


def config_path_of(explicit: Path | None) -> Path:
    return explicit or cfgmod.default_config_path()


def load_host_config(explicit: Path | None, env: Env, host_checks: bool) -> tuple[HostConfig, Path]:
    path = config_path_of(explicit)
    cfg = load_config(path)
    if host_checks:
        problems = host_problems(cfg, env.probe)
        if problems:
            raise ConfigError([f"{path}: {p}" for p in problems])
    return cfg, path


config_option = click.option(
    "--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
    help=f"host config (default ${cfgmod.CONFIG_ENV} or {cfgmod.DEFAULT_CONFIG})")
