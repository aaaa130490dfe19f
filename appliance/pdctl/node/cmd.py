"""pdctl's commands for the node on this host: `validate` and `render` (its host config and
the files rendered from it), `up`, `down`, `compose` and `logs` (under Docker Compose or as
`--local` processes) and `status` (`--cluster` hands `render` and `status` to the cluster's
commands)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from appliance.pdctl.clibase import config_option, env_of, load_host_config
from appliance.pdctl.cluster import cmd as clustercmd
from appliance.pdctl.cluster.compose import service_names
from appliance.pdctl.config import hostconfig as cfgmod
from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.errors import RUNTIME, USAGE, PdctlError
from appliance.pdctl.host.doctor import run_checks
from appliance.pdctl.node import status as st
from appliance.pdctl.node.compose import (
    compose_down,
    compose_up,
    container_states,
    exec_compose,
    timings_table,
)
from appliance.pdctl.node.dockerapi import DockerApi, DockerUnavailable
from appliance.pdctl.node.local import (
    LocalOptions,
    default_cache_dir,
    default_run_dir,
    down_local,
    follow_file,
    up_local,
)
from appliance.pdctl.node.localstate import LocalState, process_states
from appliance.pdctl.node.render import bootstrap_token_file, local_addr, read_api_keys
from appliance.pdctl.node.render import render as do_render
from appliance.pdctl.node.status import SERVICES

# ---- validate / render ------------------------------------------------------------------

@click.command()
@config_option
@click.option("--skip-host-checks", is_flag=True,
              help="only check the file (for a config meant for another host)")
@click.pass_context
def validate(ctx: click.Context, config_path: Path | None, skip_host_checks: bool) -> None:
    """Check the host config: every problem on its own line, exit 2 if any."""
    env = env_of(ctx)
    _cfg, path = load_host_config(config_path, env, not skip_host_checks)
    env.out.print(f"pdctl: {path}: ok")


@click.command()
@config_option
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False),
              help="directory to write into (default: the config's directory)")
@click.option("--skip-host-checks", is_flag=True,
              help="render a config meant for another host")
@click.option("--cluster", "cluster_path", type=click.Path(path_type=Path, dir_okay=False),
              help="a cluster description: write each host's config (and the shared keys) "
                   "into --out/<host>/ (default --out: beside FILE, named after it)")
@click.option("--kubernetes", is_flag=True,
              help="with --cluster: also the Helm chart's values.yaml for the same cluster")
@click.pass_context
def render(ctx: click.Context, config_path: Path | None, out_dir: Path | None,
           skip_host_checks: bool, cluster_path: Path | None, kubernetes: bool) -> None:
    """Write the compose env file, compose.yaml and the systemd unit (or, with --cluster,
    every host's config)."""
    env = env_of(ctx)
    if cluster_path is not None:
        if config_path is not None:
            raise PdctlError("--cluster renders every host of a description: give it "
                             "without --config", USAGE)
        clustercmd.render(env, cluster_path, out_dir, kubernetes)
        return
    if kubernetes:
        raise PdctlError("--kubernetes needs --cluster FILE (the cluster to describe)", USAGE)
    cfg, path = load_host_config(config_path, env, not skip_host_checks)
    written = do_render(cfg, path, out_dir or path.parent)
    for f in written:
        env.out.print(f"pdctl: wrote {f}")


# ---- up / down / logs -------------------------------------------------------------------

def _local_options(**kw: Any) -> Any:
    return LocalOptions(
        host=kw["host"], proxy_port=kw["port"], prefill_port=kw["prefill_port"],
        decode_port=kw["decode_port"], bootstrap_port=kw["bootstrap_port"],
        model=Path(kw["model"]).resolve() if kw["model"] else None,
        served_model_name=kw["served_model_name"],
        max_model_len=kw["max_model_len"] or 2048, kv_cache_bytes=kw["kv_cache_bytes"],
        run_dir=kw["run_dir"] or default_run_dir(), cache_dir=kw["cache_dir"] or
        default_cache_dir(), timeout=kw["timeout"] or 600.0)


run_dir_option = click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False),
                              help="--local: state and logs (default ~/.cache/pd-appliance/run "
                                   "or $PDCTL_RUN_DIR)")


@click.command()
@config_option
@click.option("--local", "local", is_flag=True,
              help="run bootstrap, P, D and the proxy as local processes (CPU build, tiny "
                   "model, Mooncake over TCP), no containers")
@click.option("--host", default="127.0.0.1", show_default=True, help="--local: listen address")
@click.option("--port", default=8000, show_default=True, type=int, help="--local: proxy port")
@click.option("--prefill-port", default=8010, show_default=True, type=int)
@click.option("--decode-port", default=8020, show_default=True, type=int)
@click.option("--bootstrap-port", default=8998, show_default=True, type=int)
@click.option("--model", type=click.Path(file_okay=False, exists=True),
              help="--local: a model directory (default: the tiny model, built on first use)")
@click.option("--served-model-name", help="--local: the model's name in requests")
@click.option("--max-model-len", type=click.IntRange(16),
              help="--local: longest request in tokens (default 2048)")
@click.option("--kv-cache-bytes", type=click.IntRange(1 << 20),
              help="--local: KV cache per vLLM server (default: sized from the model for a "
                   "few requests of max-model-len)")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False),
              help="--local: where the tiny model is built (default ~/.cache/pd-appliance)")
@run_dir_option
@click.option("--detach", is_flag=True, help="--local: return once healthy, leave it running")
@click.option("--timeout", type=float, help="seconds to wait for healthy")
@click.option("--no-wait", is_flag=True, help="compose: do not wait for healthy")
@click.option("--skip-doctor", is_flag=True, help="compose: start even if host checks fail")
@click.pass_context
def up(ctx: click.Context, config_path: Path | None, local: bool, no_wait: bool,
       skip_doctor: bool, detach: bool, **kw: Any) -> None:
    """Start the node: docker compose (from the host config) or --local processes."""
    env = env_of(ctx)
    if local:
        ctx.exit(up_local(_local_options(**kw), env.out, detach=detach))
    if detach:
        raise click.UsageError("--detach only applies with --local (compose always detaches)")

    cfg, path = load_host_config(config_path, env, host_checks=True)
    if not skip_doctor:
        failed = [c for c in run_checks(cfg, env.probe) if c.status == "fail"]
        if failed:
            raise PdctlError([f"doctor: {c.name}: {c.detail} (fix: {c.fix})" for c in failed]
                             + ["not starting; fix the above or pass --skip-doctor"])
    out_dir = path.parent
    do_render(cfg, path, out_dir)
    timings = compose_up(cfg, out_dir, env.runner, env.out, wait=not no_wait,
                         timeout=kw["timeout"])
    if timings:
        env.out.print(timings_table(timings))
        env.out.print(f"pdctl: node healthy after {timings['total']:.1f} s; proxy on "
                      f"http://{cfg.host.ip}:{cfg.ports.proxy}")


@click.command()
@config_option
@click.option("--local", "local", is_flag=True, help="stop the node `up --local` started")
@run_dir_option
@click.pass_context
def down(ctx: click.Context, config_path: Path | None, local: bool,
         run_dir: Path | None) -> None:
    """Stop the node (docker compose down, or the --local processes)."""
    env = env_of(ctx)
    if local:
        ctx.exit(down_local(run_dir or default_run_dir(), env.out))

    cfg, path = load_host_config(config_path, env, host_checks=False)
    compose_down(cfg, path.parent, env.runner, env.out)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@config_option
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def compose(ctx: click.Context, config_path: Path | None, args: tuple[str, ...]) -> None:
    """Run Compose on the rendered node (the engine's plugin, else the bundled Compose v2):
    `pdctl compose -- ps`, `pdctl compose -- up -d` (the systemd unit runs this)."""
    cfg, path = load_host_config(config_path, env_of(ctx), host_checks=False)
    exec_compose(cfg, path.parent, env_of(ctx).runner, list(args))


@click.command()
@click.argument("service", required=False)
@config_option
@click.option("--local", "local", is_flag=True, help="logs of the --local node")
@run_dir_option
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines (needs SERVICE)")
@click.option("--tail", default=100, show_default=True, type=int,
              help="lines from the end (0: all)")
@click.pass_context
def logs(ctx: click.Context, service: str | None, config_path: Path | None, local: bool,
         run_dir: Path | None, follow: bool, tail: int) -> None:
    """Print a service's log (every service's when SERVICE is left out): bootstrap, prefill,
    decode, proxy; on a cluster host prefill-0, decode-1, ... as it runs them."""
    if follow and service is None:
        raise click.UsageError("--follow needs a SERVICE")
    cfg = None if local else load_host_config(config_path, env_of(ctx), host_checks=False)[0]
    known = SERVICES if cfg is None else service_names(cfg)
    if service is not None and service not in known:
        raise click.UsageError(f"no service {service!r} here (this node runs: "
                               f"{', '.join(known)})")
    names = [service] if service else list(known)
    if local:
        log_dir = (run_dir or default_run_dir()) / "logs"
        for name in names:
            path = log_dir / f"{name}.log"
            if not path.exists():
                raise PdctlError(f"no log for {name} in {log_dir} (has `pdctl up --local` run?)")
            if len(names) > 1:
                click.echo(f"==> {name} <==")
            follow_file(path, tail, follow, click.echo)
        return

    assert cfg is not None
    api = DockerApi.connect()
    for name in names:
        if len(names) > 1:
            click.echo(f"==> {name} <==")
        for chunk in api.logs(cfg.compose.project, name, tail=tail or "all", follow=follow):
            click.echo(chunk.decode(errors="replace"), nl=False)


# ---- status / doctor --------------------------------------------------------------------

@click.command()
@config_option
@click.option("--local", "local", is_flag=True,
              help="the --local node (the default when one runs and no --config is given)")
@run_dir_option
@click.option("--cluster", "cluster_path", type=click.Path(path_type=Path, dir_okay=False),
              help="the whole cluster this description names (every host's P, D, sidecar "
                   "and the proxy)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def status(ctx: click.Context, config_path: Path | None, local: bool, run_dir: Path | None,
           cluster_path: Path | None, as_json: bool) -> None:
    """Every service: up/down, health, engine ids, backends, counters. Exit 1 if unhealthy."""
    env = env_of(ctx)
    if cluster_path is not None:
        if local or config_path is not None:
            raise PdctlError("--cluster reports on a whole cluster: give it alone, without "
                             "--local or --config", USAGE)
        clustercmd.status(ctx, cluster_path, as_json)
        return
    run_dir = run_dir or default_run_dir()
    state = LocalState.load(run_dir) if (local or config_path is None) else None
    if local and state is None:
        raise PdctlError(f"no local node is running (no state in {run_dir})")
    if state is None and config_path is None and not cfgmod.default_config_path().exists():
        raise PdctlError(f"no node to report on: no local node (no state in {run_dir}) and no "
                         f"host config at {cfgmod.default_config_path()}")
    if state is not None:
        token_file = run_dir / "keys" / "bootstrap-token"
        node = st.gather(state.endpoints_obj(), process_states(state), "local",
                         bootstrap_token=_read_quietly(token_file))
    else:
        cfg, path = load_host_config(config_path, env, host_checks=False)
        if cfg.cluster is not None:
            clustercmd.host_status(ctx, cfg, as_json)
            return

        base = f"http://{cfg.host.ip}"  # P, D and the sidecar listen on the internal address
        scheme = "https" if cfg.tls.cert_file else "http"
        endpoints = st.Endpoints(bootstrap=f"{base}:{cfg.ports.bootstrap}",
                                 prefill=f"{base}:{cfg.ports.prefill}",
                                 decode=f"{base}:{cfg.ports.decode}",
                                 proxy=f"{scheme}://{local_addr(cfg)}:{cfg.ports.proxy}",
                                 prefill_engine_id=cfg.prefill_engine_id)
        problems: list[str] = []
        processes: dict[str, st.ProcessState] | None = None
        try:
            api = DockerApi.connect()
            processes = container_states(api, cfg.compose.project, st.SERVICES)
        except DockerUnavailable as exc:
            problems.append(f"docker: {exc.lines[0]}")
        node = st.gather(endpoints, processes, f"compose project {cfg.compose.project}",
                         problems, api_key=_first_key(cfg),
                         bootstrap_token=_read_quietly(Path(bootstrap_token_file(cfg,
                                                                                 path.parent))))
    if as_json:
        click.echo(json.dumps(node.as_dict(), indent=1))
    else:
        st.render_table(node, env.out)
    ctx.exit(0 if node.healthy else RUNTIME)


def _read_quietly(path: Path) -> str | None:
    """A key file's value, or None where it cannot be read (status then shows the 401)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _first_key(cfg: HostConfig) -> str | None:
    if not cfg.auth.api_keys_file:
        return None

    try:
        keys = read_api_keys(Path(cfg.auth.api_keys_file))
    except OSError:
        return None
    return keys[0] if keys else None
