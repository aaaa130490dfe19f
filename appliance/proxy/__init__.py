"""The PD proxy on port 8000: splits each request into a prefill (P) and a decode (D) request,
streams D's answer back, routes across nodes, cancels on failure, reports health and metrics.

    python -m appliance.proxy --port 8000 --prefill http://p:8010,http://p:8998 \\
        --decode http://d:8020 [--policy least_outstanding] [--config proxy.toml]

A config file holds ProxySettings keys, at top level or under `[proxy]`:

    [proxy]
    port = 8000
    policy = "round_robin"
    [[proxy.prefill]]
    url = "http://10.0.0.1:8010"
    bootstrap_url = "http://10.0.0.1:8998"
    [[proxy.decode]]
    url = "http://10.0.0.2:8020"

Modules: settings (file + flags), split (the P and D bodies), upstream (the lean HTTP/1.1
client for P and D), backends (nodes, their membership and the health poller), discovery
(Kubernetes pods as nodes), routing (policies), metrics, errors, response (one upstream
answer, parsed by llhttp), admission (overload control), admin (drain), app (shared state,
each request's entry), exchange (P and D for each request), ownership and release (who
frees P's KV), relay (D's answer to the client), record (the access log), server (the
aiohttp application, its ops endpoints, serve()).
"""

from appliance.proxy.server import RunningProxy, build_app, serve
from appliance.proxy.settings import DecodeNode, PrefillNode, ProxySettings, load_settings

__all__ = [
    "DecodeNode",
    "PrefillNode",
    "ProxySettings",
    "RunningProxy",
    "build_app",
    "load_settings",
    "serve",
]
