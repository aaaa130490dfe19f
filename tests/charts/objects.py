"""Reading rendered objects: workloads by role, their containers, ports and arguments."""

from __future__ import annotations

import json
from typing import Any

Doc = dict[str, Any]
COMPONENT = "app.kubernetes.io/component"


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def workload(docs: list[Doc], component: str) -> Doc:
    (w,) = [d for d in of_kind(docs, "Deployment")
            if d["metadata"]["labels"][COMPONENT] == component]
    return w


def pod(w: Doc) -> Doc:
    return w["spec"]["template"]["spec"]


def container(w: Doc, name: str) -> Doc:
    (c,) = [c for c in pod(w)["containers"] if c["name"] == name]
    return c


def flag(args: list[str], name: str) -> str:
    """The value after `name` in an argument list (exactly once)."""
    at = [i for i, a in enumerate(args) if a == name]
    assert len(at) == 1, f"{name} appears {len(at)} times in {args}"
    return args[at[0] + 1]


def kv_config(w: Doc) -> dict[str, Any]:
    return json.loads(flag(container(w, "vllm")["args"], "--kv-transfer-config"))


def port_number(c: Doc, port: int | str) -> int:
    """A probe's or a Service's target port, by number or by the container port's name."""
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if isinstance(port, str):
        assert port in ports, f"{c['name']} has no port named {port} ({ports})"
        return ports[port]
    assert port in ports.values(), f"{c['name']} does not listen on {port}"
    return port


def probes(c: Doc) -> list[tuple[str, Doc]]:
    return [(k, c[k]) for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]


def probe_port(probe: Doc) -> int | str:
    action = probe.get("httpGet") or probe.get("tcpSocket")
    assert action, f"probe without httpGet or tcpSocket: {probe}"
    return action["port"]


def env(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def mounted_file(docs: list[Doc], w: Doc, c: Doc, path: str) -> str:
    """The text of a file a container reads from a mounted ConfigMap."""
    folder, _, name = path.rpartition("/")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in pod(w)["volumes"] if v["name"] == mount["name"]]
    (cm,) = [d for d in of_kind(docs, "ConfigMap")
             if d["metadata"]["name"] == volume["configMap"]["name"]]
    return str(cm["data"][name])


def proxy_settings(docs: list[Doc]) -> dict[str, Any]:
    """What the chart's proxy is told, by ProxySettings' keys: its config file (a mounted
    ConfigMap) with its arguments over it, merged as the proxy merges them."""
    import tomllib

    from appliance import modelflags
    from appliance.proxy.settings import ProxySettings, build_parser

    w = workload(docs, "proxy")
    c = container(w, "proxy")
    assert c["args"][:3] == ["python", "-m", "appliance.proxy"]
    args = vars(build_parser().parse_args(c["args"][3:]))
    data = tomllib.loads(mounted_file(docs, w, c, str(args.pop("config"))))
    return modelflags.given(ProxySettings, args, {}, data)
