"""`pdctl top`: a live view of the node (appliance.pdctl.top.view), refreshed every second until
Ctrl-C; `--once` prints one frame, `--json` its numbers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.live import Live

from appliance.pdctl.clibase import config_option, env_of
from appliance.pdctl.cluster.description import load_cluster
from appliance.pdctl.errors import RUNTIME, USAGE, PdctlError
from appliance.pdctl.node.admincmd import proxy_target
from appliance.pdctl.top import view


def _key(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except OSError:
        return None  # a node without keys answers this host without one


@click.command()
@config_option
@click.option("--local", "local", is_flag=True, help="the --local node")
@click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False),
              help="--local: its state directory")
@click.option("--cluster", "cluster_path", type=click.Path(path_type=Path, dir_okay=False),
              help="the cluster this description names (its proxy, and every node it knows)")
@click.option("--proxy", "proxy_url", metavar="URL", help="any proxy, by its URL")
@click.option("--api-key-file", type=click.Path(path_type=Path, dir_okay=False),
              help="--proxy/--cluster: the bearer key the proxy asks for")
@click.option("--interval", type=float, default=1.0, show_default=True, metavar="SECONDS",
              help="refresh period (and --once's window)")
@click.option("--once", is_flag=True, help="print one frame and exit")
@click.option("--json", "as_json", is_flag=True, help="one frame's numbers as JSON")
@click.pass_context
def top(ctx: click.Context, config_path: Path | None, local: bool, run_dir: Path | None,
        cluster_path: Path | None, proxy_url: str | None, api_key_file: Path | None,
        interval: float, once: bool, as_json: bool) -> None:
    """Live view: request rate, client TTFT/ITL, each node's queue, KV usage and transfers."""
    if interval <= 0:
        raise PdctlError("--interval must be positive", USAGE)
    if sum(bool(x) for x in (proxy_url, cluster_path, local or config_path)) > 1:
        raise PdctlError("give one of --proxy, --cluster, or --local/--config", USAGE)
    if proxy_url is not None:
        url, key_file = proxy_url.rstrip("/"), api_key_file
    elif cluster_path is not None:
        plan = load_cluster(cluster_path).plan()
        assert plan.proxy_url is not None  # a whole cluster's plan names its proxy
        url, key_file = plan.proxy_url, api_key_file
    else:
        url, key_file = proxy_target(config_path, local, run_dir)
    key = _key(key_file)
    out = env_of(ctx).out
    before = view.take(url, key)
    if before.error:
        raise PdctlError(f"cannot read the proxy at {url}: {before.error}")
    if once or as_json:
        time.sleep(interval)
        f = view.frame(before, view.take(url, key))
        if as_json:
            click.echo(json.dumps(f, indent=1))
        else:
            out.print(view.render(f, url))
        ctx.exit(RUNTIME if f.get("proxy_error") else 0)
    with Live(view.render(view.frame(before, before), url), console=out,
              refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                now = view.take(url, key)
                live.update(view.render(view.frame(before, now), url))
                if not now.error:
                    before = now
        except KeyboardInterrupt:
            return
