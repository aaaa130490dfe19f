"""The host config's [proxy]: the proxy's own settings, by the keys of its config file
(ProxySettings' fields; `python -m appliance.proxy --help` lists them with their flags),
passed through to the proxy.toml `pdctl render` writes. Each value is checked by the
ProxySettings field it is for, so a typo or a bad value is one line here, not a proxy
that fails to start.

What pdctl derives from the other sections (where the proxy listens, its P and D, the
waits it shares with P and D, the keys, TLS, tracing, the model) it writes itself; a
[proxy] key for one of those is refused, naming where it is set."""

from __future__ import annotations

from appliance.modelpart import optional_fields
from appliance.pdctl.config.sections import Section
from appliance.proxy.settings import ProxySettings

_KEYS = "keys/ beside the rendered files (pdctl init)"

# Each proxy setting pdctl writes itself -> where the host config says it.
MANAGED: dict[str, str] = {
    "host": "compose.bind",
    "port": "ports.proxy",
    "discovery": "the node (static: its own P and D, or its [cluster] part)",
    "kubernetes": "the chart (pdctl render --kubernetes), not a host",
    "prefill": "the node's own P, or [cluster] prefill_backends",
    "decode": "the node's own D, or [cluster] decode_backends",
    "prefill_timeout_s": "timeouts.prefill_s (P and D wait by it too)",
    "kv_transfer_s": "timeouts.kv_transfer_s (P and D wait by it too)",
    "decode_read_timeout_s": "timeouts.decode_read_s",
    "drain_grace_s": "compose.yaml (within the proxy's stop_grace_period)",
    "tokenizer": "model.path",
    "kv_block_size": "model.block_size",
    "decode_prefill_chunk": "model.decode_prefill_chunk",
    "api_keys": "auth.api_keys_file",
    "auth_ops_endpoints": "auth.protect_ops_endpoints",
    "backend_api_key": _KEYS,
    "backend_api_key_file": _KEYS,
    "bootstrap_token": f"auth.bootstrap_token_file, else {_KEYS}",
    "bootstrap_token_file": f"auth.bootstrap_token_file, else {_KEYS}",
    "side_channel_key_file": _KEYS,
    "tls_cert_file": "tls.cert_file",
    "tls_key_file": "tls.key_file",
    "otlp_traces_endpoint": "tracing.otlp_endpoint (P and D export there too)",
    "otlp_traces_protocol": "tracing.protocol",
    "otlp_traces_sample_ratio": "tracing.sample_ratio",
}


class ProxyKeys(Section):
    """What a [proxy] section checks beyond each value: no key pdctl sets itself."""

    def managed(self) -> list[str]:
        """One line per key given here that pdctl writes from another section."""
        return [f"proxy.{key}: pdctl sets it from {where}" for key, where in MANAGED.items()
                if getattr(self, key, None) is not None]

    def settings(self) -> dict[str, object]:
        """The keys given, as the proxy's file takes them."""
        return self.model_dump(exclude_none=True)


ProxySection = optional_fields(ProxySettings, "ProxySection", ProxyKeys, __name__, __doc__)
