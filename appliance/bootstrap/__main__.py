"""`python -m appliance.bootstrap --host --port --ttl --token-file FILE | --no-token`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
from aiohttp import web
from pydantic import ValidationError

from appliance.bootstrap.app import build_app
from appliance.bootstrap.settings import DEFAULT_PORT, BootstrapSettings


@click.command()
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int)
@click.option("--ttl", default=30.0, show_default=True, type=float,
              help="Seconds a registration lives without a refresh (0: forever).")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False),
              help="File holding the shared token that /register, DELETE and /query require.")
@click.option("--no-token", is_flag=True,
              help="Run without a token: anyone who reaches the port may register an engine "
                   "(the reference's trust model; tests and vLLM's own connector).")
@click.option("--max-body-bytes", default=64 * 1024, show_default=True, type=int)
@click.option("--log-level", default="INFO", show_default=True)
def main(host: str, port: int, ttl: float, token_file: Path | None, no_token: bool,
         max_body_bytes: int, log_level: str) -> None:
    """Run the bootstrap sidecar."""
    if (token_file is None) == (not no_token):
        click.echo("bootstrap: error: give --token-file FILE (the shared token) or --no-token"
                   if token_file is None else
                   "bootstrap: error: --token-file and --no-token exclude each other", err=True)
        sys.exit(2)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token = BootstrapSettings.read_token(token_file) if token_file else None
        settings = BootstrapSettings(host=host, port=port, ttl=ttl, token=token,
                                     max_body_bytes=max_body_bytes)
    except (OSError, ValueError, ValidationError) as exc:
        msg = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else \
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        click.echo(f"bootstrap: error: {msg}", err=True)
        sys.exit(2)
    web.run_app(build_app(settings), host=settings.host, port=settings.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
