"""`python -m appliance.proxy --port 8000 --prefill URL[,BOOTSTRAP] ... --decode URL ...`."""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Sequence

from aiohttp import web
from pydantic import ValidationError

from appliance.proxy import heap
from appliance.proxy.server import build_app
from appliance.proxy.settings import load_settings


def _raise_open_files_limit() -> None:
    """Each client holds a socket and so does each of its two upstream calls: a thousand
    streams need three thousand descriptors, above many hosts' soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # keep the soft limit; the proxy still runs, with fewer clients at once


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = load_settings(argv)
        tls = settings.listener_ssl()
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValidationError):
            # A whole-settings check (no field to name) is its own sentence.
            msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"]
                            else e["msg"].removeprefix("Value error, ") for e in exc.errors())
        else:
            msg = str(exc)
        print(f"proxy: error: {msg}", file=sys.stderr)
        sys.exit(2)
    if settings.discovery == "static" and (not settings.prefill or not settings.decode):
        print("proxy: error: at least one --prefill and one --decode are needed", file=sys.stderr)
        sys.exit(2)
    _raise_open_files_limit()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    k8s = settings.kubernetes
    nodes = (f"pods in {k8s.namespace} via {k8s.api_server}: prefill {k8s.prefill_selector!r} "
             f"(:{k8s.prefill_port}, bootstrap :{k8s.bootstrap_port}), decode "
             f"{k8s.decode_selector!r} (:{k8s.decode_port})"
             if settings.discovery == "kubernetes" else
             f"prefill {[f'{n.url} ({n.bootstrap_url})' for n in settings.prefill]}, "
             f"decode {[n.url for n in settings.decode]}")
    logging.getLogger("appliance.proxy").info(
        "proxy on %s://%s:%d: %s, policy %s", "https" if tls else "http", settings.host,
        settings.port, nodes, settings.policy)
    # handler_cancellation: a client that hangs up cancels its handler, which closes both
    # upstream connections, so vLLM aborts the requests.
    app = build_app(settings)
    app.on_startup.append(heap.settled)  # after the proxy's own start (the tokenizer)
    app.cleanup_ctx.append(heap.trimmed())
    web.run_app(app, host=settings.host, port=settings.port, print=None,
                access_log=None, handler_cancellation=True, ssl_context=tls,
                # on_shutdown waits drain_grace_s itself (appliance.proxy.admin); past it
                # every request left has been ended with an error.
                shutdown_timeout=5.0)


if __name__ == "__main__":
    main()
