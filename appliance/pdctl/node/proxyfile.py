"""The proxy's config file (proxy.toml) on a host that runs the proxy: compose.yaml starts
it with `--config` on this one file. Its keys are ProxySettings' fields: the host config's
[proxy] as written, and what pdctl derives from the other sections (where the proxy
listens, its P and D, the waits it shares with them, the keys' files, TLS, tracing, the
model; appliance.pdctl.config.proxysection.MANAGED names each). It may hold the clients'
API keys, so it is written 0600."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance import keys
from appliance.netaddr import host_port
from appliance.pdctl.config.hostconfig import HostConfig
from appliance.pdctl.config.toml import toml_lines
from appliance.proxy.nodesettings import parse_decode_flag, parse_prefill_flag

FILE = "proxy.toml"
# Within compose.yaml's stop_grace_period for the proxy (45 s): then SIGKILL.
DRAIN_GRACE_S = 30.0


def backends(cfg: HostConfig) -> dict[str, list[dict[str, str]]]:
    """The proxy's P and D: this node's own, or a cluster's as its description says."""
    if cfg.cluster is not None:
        prefill, decode = cfg.cluster.prefill_backends, cfg.cluster.decode_backends
    else:
        ip = cfg.host.ip
        prefill = [f"http://{host_port(ip, cfg.ports.prefill)},"
                   f"http://{host_port(ip, cfg.ports.bootstrap)}"]
        decode = [f"http://{host_port(ip, cfg.ports.decode)}"]
    return {"prefill": [parse_prefill_flag(u) for u in prefill],
            "decode": [parse_decode_flag(u) for u in decode]}


def proxy_settings(cfg: HostConfig, node_keys: keys.NodeKeys, token_file: str,
                   client_keys: list[str]) -> dict[str, Any]:
    """The file's settings: the host config's [proxy], then what pdctl derives."""
    t = cfg.timeouts
    derived: dict[str, Any] = {
        "host": cfg.compose.bind, "port": cfg.ports.proxy, **backends(cfg),
        "prefill_timeout_s": t.prefill_s, "kv_transfer_s": t.kv_transfer_s,
        "decode_read_timeout_s": t.decode_read_s, "drain_grace_s": DRAIN_GRACE_S,
        # The model's folder is mounted in the proxy's container too: prompts are tokenized
        # there, and hashed by the engines' block size from the first request on.
        "tokenizer": cfg.model.path, "kv_block_size": cfg.block_size,
        # auto weighs a local prefill by the chunk D computes it in (0: no cap, unknown)
        "decode_prefill_chunk": cfg.decode_prefill_chunk or None,
        "backend_api_key_file": str(node_keys.api_key), "bootstrap_token_file": token_file,
        "side_channel_key_file": str(node_keys.side_channel_key),
        **cfg.tracing.proxy_settings(),
    }
    if client_keys:
        derived |= {"api_keys": client_keys,
                    "auth_ops_endpoints": cfg.auth.protect_ops_endpoints}
    if cfg.tls.cert_file and cfg.tls.key_file:
        derived |= {"tls_cert_file": cfg.tls.cert_file, "tls_key_file": cfg.tls.key_file}
    return {**cfg.proxy.settings(), **derived}


def file_text(settings: dict[str, Any], source: Path | None = None) -> str:
    head = (f"# Written by `pdctl render`{f' from {source}' if source else ''}: the proxy's "
            f"settings (python -m appliance.proxy --help).\n# Edit the host config's [proxy] "
            f"(and the sections the rest comes from), not this file.\n")
    return head + "\n".join(toml_lines(settings)) + "\n"
