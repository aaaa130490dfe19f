"""`pdctl doctor`: the preflight of this host (appliance.pdctl.host.doctor), as a table or
JSON."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from appliance.pdctl.clibase import config_option, config_path_of, env_of
from appliance.pdctl.config.hostconfig import load_config
from appliance.pdctl.errors import RUNTIME
from appliance.pdctl.host.doctor import run_checks
from appliance.pdctl.host.verdict import Check


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--skip", "skips", multiple=True, metavar="CHECK",
              help="leave a check out, e.g. --skip ports (repeatable)")
@click.pass_context
def doctor(ctx: click.Context, config_path: Path | None, as_json: bool,
           skips: tuple[str, ...]) -> None:
    """Check this host before starting: GPUs, GPUDirect, RDMA, memlock, ports, Docker, and
    what the node would expose (warnings)."""
    env = env_of(ctx)
    path = config_path_of(config_path)
    cfg = load_config(path) if (config_path is not None or path.exists()) else None
    skip = {s.lower() for s in skips}
    checks = [Check(c.name, "skip", "--skip") if c.name.lower() in skip else c
              for c in run_checks(cfg, env.probe)]
    failed = [c for c in checks if c.status == "fail"]
    if as_json:
        click.echo(json.dumps({"config": str(path) if cfg else None, "ok": not failed,
                               "checks": [c.as_dict() for c in checks]}, indent=1))
    else:
        out = env.out
        if cfg is None:
            out.print(f"pdctl: no host config at {path}: generic checks only")
        table = Table(title="host checks" + (f" for {path}" if cfg else ""),
                      title_justify="left")
        for col in ("check", "result", "detail"):
            table.add_column(col, overflow="fold")
        colors = {"pass": "green", "fail": "red", "skip": "yellow", "warn": "magenta"}
        for c in checks:
            # Details and fixes are plain text: "[ports]" is a config section, not markup.
            detail = escape(c.detail) + (f"\n[bold]fix:[/] {escape(c.fix)}" if c.fix else "")
            table.add_row(escape(c.name), f"[{colors[c.status]}]{c.status}[/]", detail)
        out.print(table)
        out.print(f"{len(failed)} failed, {sum(c.status == 'pass' for c in checks)} passed, "
                  f"{sum(c.status == 'warn' for c in checks)} warnings, "
                  f"{sum(c.status == 'skip' for c in checks)} skipped")
    ctx.exit(RUNTIME if failed else 0)
