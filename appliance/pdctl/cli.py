"""pdctl: configure, check, start, watch and stop a 1P1D pd-appliance node.

Errors are one line each, `pdctl: error: ...`; exit code 2 for bad flags or config, 1 for
failures on the host or in a service.
"""

from __future__ import annotations

import click

from appliance.pdctl.clibase import PdctlGroup, env_of
from appliance.pdctl.host.doctorcmd import doctor
from appliance.pdctl.host.init import init
from appliance.pdctl.node.admincmd import drain, tracing
from appliance.pdctl.node.cmd import compose, down, logs, render, status, up, validate
from appliance.pdctl.top.cmd import top

__all__ = ["cli", "main"]


@click.group(cls=PdctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Configure, check, start, watch and stop a pd-appliance 1P1D node.

    \b
    Try it on this machine (CPU build, tiny model, no containers):
      pdctl up --local            # proxy on :8000; Ctrl-C stops it
    On a GPU host:
      pdctl init --model /models/X && pdctl doctor && pdctl up && pdctl status
    """
    env_of(ctx)


cli.add_command(init)
cli.add_command(validate)
cli.add_command(render)
cli.add_command(up)
cli.add_command(down)
cli.add_command(compose)
cli.add_command(logs)
cli.add_command(status)
cli.add_command(doctor)
cli.add_command(drain)
cli.add_command(tracing)
cli.add_command(top)


def main() -> None:
    cli.main(prog_name="pdctl")


if __name__ == "__main__":
    main()
