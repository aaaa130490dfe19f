"""pdctl's cluster commands: `render --cluster` (every host's config) and `status --cluster`
(the whole cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from appliance.pdctl.clibase import Env, env_of
from appliance.pdctl.cluster import status as clusterstatus
from appliance.pdctl.cluster.compose import service_names
from appliance.pdctl.cluster.description import host_plan, load_cluster
from appliance.pdctl.cluster.render import render_cluster
from appliance.pdctl.cluster.status import ClusterStatus
from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.errors import RUNTIME
from appliance.pdctl.node.dockerapi import DockerApi, DockerUnavailable


def render(env: Env, path: Path, out_dir: Path | None, kubernetes: bool) -> None:
    desc = load_cluster(path)
    out = out_dir or path.parent / path.stem
    for f in render_cluster(desc, path.resolve(), out, kubernetes):
        env.out.print(f"pdctl: wrote {f}")
    for h in desc.hosts:
        runs = [f"{len(getattr(h, r))} {r}" for r in ("prefill", "decode") if getattr(h, r)]
        runs += ["the proxy"] if h.name == desc.proxy.host else []
        env.out.print(f"pdctl: {h.name} ({h.ip}; {', '.join(runs)}): copy "
                      f"{out.resolve() / h.name}/ to /etc/pd-appliance/ there, then `pdctl up`")


def status(ctx: click.Context, path: Path, as_json: bool) -> None:
    _report(ctx, clusterstatus.gather(load_cluster(path).plan()), as_json)


def host_status(ctx: click.Context, cfg: HostConfig, as_json: bool) -> None:
    """`pdctl status` on a cluster host: its instances, sidecars and proxy (where it runs
    here), and its containers; `--cluster FILE` shows every host."""
    status = clusterstatus.gather(host_plan(cfg))
    try:
        clusterstatus.add_containers(status, DockerApi.connect().project(cfg.compose.project),
                                     service_names(cfg))
    except DockerUnavailable as exc:
        status.problems.append(f"docker: {exc.lines[0]}")
    _report(ctx, status, as_json)


def _report(ctx: click.Context, status: ClusterStatus, as_json: bool) -> None:
    """Table or JSON; exit 1 unless healthy."""
    if as_json:
        click.echo(json.dumps(status.as_dict(), indent=1))
    else:
        clusterstatus.render_table(status, env_of(ctx).out)
    ctx.exit(0 if status.healthy else RUNTIME)
