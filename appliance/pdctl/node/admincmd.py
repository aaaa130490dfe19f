"""pdctl's commands on the proxy's admin API (appliance.proxy.admin).

`pdctl drain NODE`: take a node out of the proxy's rotation (it gets nothing new, what it
has finishes); `--undo` puts it back. NODE is `prefill`, `decode` (every node of that role)
or a node's URL. `pdctl down` needs no drain first: SIGTERM drains the proxy itself.

`pdctl tracing [--sample-ratio R] [--on | --off]`: how the proxy traces, changed without a
restart (an incident's few minutes at ratio 1, then back)."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from appliance.pdctl.clibase import config_option, config_path_of, env_of
from appliance.pdctl.config.hostconfig import load_config
from appliance.pdctl.errors import RUNTIME, USAGE, PdctlError
from appliance.pdctl.node.local import default_run_dir
from appliance.pdctl.node.localstate import LocalState
from appliance.pdctl.node.render import keys_dir, local_addr


def proxy_target(config_path: Path | None, local: bool, run_dir: Path | None) -> tuple[str, Path]:
    """(the proxy's URL, the node's keys/api-key file)."""
    run_dir = run_dir or default_run_dir()
    state = LocalState.load(run_dir) if (local or config_path is None) else None
    if state is not None:
        return state.endpoints["proxy"], run_dir / "keys" / "api-key"
    if local:
        raise PdctlError(f"no local node is running (no state in {run_dir})")

    path = config_path_of(config_path)
    if not path.exists():
        raise PdctlError(f"no node: no local node (no state in {run_dir}) and no "
                         f"host config at {path}")
    cfg = load_config(path)
    scheme = "https" if cfg.tls.cert_file else "http"
    return (f"{scheme}://{local_addr(cfg)}:{cfg.ports.proxy}",
            keys_dir(path.parent.resolve()) / "api-key")


def _call(url: str, key_file: Path, body: dict | None = None, method: str = "POST") -> dict:
    headers = {"Content-Type": "application/json"}
    try:
        headers["Authorization"] = f"Bearer {key_file.read_text().strip()}"
    except OSError:
        pass  # a node without keys takes admin calls from this host alone
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers, method="GET" if body is None else method)
    ctx = ssl._create_unverified_context() if url.startswith("https:") else None  # ours
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            reason = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = exc.reason
        raise PdctlError(f"the proxy answered {exc.code}: {reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PdctlError(f"cannot reach the proxy at {url}: "
                         f"{getattr(exc, 'reason', exc)}") from None


@click.command()
@click.argument("node")
@config_option
@click.option("--local", "local", is_flag=True, help="the --local node")
@click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False),
              help="--local: its state directory")
@click.option("--undo", is_flag=True, help="put the node back in rotation")
@click.option("--wait", type=float, default=0.0, show_default=True, metavar="SECONDS",
              help="wait until the drained nodes hold no request (exit 1 if they still do)")
@click.option("--handover-after", type=float, default=None, metavar="SECONDS",
              help="what the nodes still answer after this long goes on from other engines "
                   "(0: never; default: the proxy's drain_handover_s, 120)")
@click.pass_context
def drain(ctx: click.Context, node: str, config_path: Path | None, local: bool,
          run_dir: Path | None, undo: bool, wait: float, handover_after: float | None) -> None:
    """Take NODE (prefill, decode, or a node's URL) out of the proxy's rotation."""
    out = env_of(ctx).out
    if wait < 0 or (handover_after is not None and handover_after < 0):
        raise PdctlError("--wait and --handover-after must not be negative", USAGE)
    proxy, key_file = proxy_target(config_path, local, run_dir)
    body: dict = {"node": node}
    if handover_after is not None and not undo:
        body["handover_after_s"] = handover_after
    answer = _call(f"{proxy}/admin/{'undrain' if undo else 'drain'}", key_file, body)
    names = set(answer["changed"])  # the nodes NODE named, as the proxy matched them
    deadline = time.monotonic() + wait
    while True:
        nodes = [n for n in answer["nodes"] if n["url"] in names]
        busy = sum(n["in_flight"] for n in nodes)
        if undo or not busy or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
        answer = _call(f"{proxy}/admin/drain", key_file)
    for n in nodes:
        what = "draining" if n["draining"] else "in rotation"
        out.print(f"pdctl: {n['role']} {n['url']}: {what}, {n['in_flight']} in flight")
    if wait and not undo and busy:
        out.print(f"pdctl: still {busy} in flight after {wait:g} s")
        ctx.exit(RUNTIME)


@click.command()
@config_option
@click.option("--local", "local", is_flag=True, help="the --local node")
@click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False),
              help="--local: its state directory")
@click.option("--sample-ratio", type=click.FloatRange(0, 1), metavar="RATIO",
              help="the share of requests traced, 0 to 1")
@click.option("--on/--off", "enabled", default=None,
              help="resume, or pause (requests go as if no endpoint were set)")
@click.pass_context
def tracing(ctx: click.Context, config_path: Path | None, local: bool, run_dir: Path | None,
            sample_ratio: float | None, enabled: bool | None) -> None:
    """Show how the proxy traces requests, or change it without a restart."""
    proxy, key_file = proxy_target(config_path, local, run_dir)
    url = f"{proxy}/admin/tracing"
    change = {k: v for k, v in (("sample_ratio", sample_ratio), ("enabled", enabled))
              if v is not None}
    state = _call(url, key_file, change, method="PUT") if change else _call(url, key_file)
    spans = state.get("spans", {})
    env_of(ctx).out.print(
        f"pdctl: tracing {'on' if state['enabled'] else 'paused'}, "
        f"{state['sample_ratio']:.0%} of requests sampled, to {state['endpoint']} "
        f"({state['protocol']}); spans exported {spans.get('exported', 0)}, "
        f"dropped {spans.get('dropped', 0)}")
