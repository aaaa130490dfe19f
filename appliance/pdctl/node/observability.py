"""A 1P1D node's own Prometheus and Grafana: compose's opt-in `observability` profile.

`pdctl render` writes their files under `observability/` beside compose.yaml: Prometheus'
scrape config for this node (the proxy, P and D, labelled `pd_role` as the alert rules and
the dashboard select on) with the shipped alert rules, and Grafana's provisioning (that
Prometheus as the default data source, the shipped dashboard). The host config's
`[observability] enabled = true` turns the profile on (COMPOSE_PROFILES in .env); a plain
`docker compose --profile observability up -d` in the rendered directory does too. Both
listen on `[observability] listen` (127.0.0.1 by default: reach them through an SSH tunnel
or set the node's address). A cluster scrapes with config/prometheus/ instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from appliance.netaddr import host_port
from appliance.pdctl.config.hostconfig import HostConfig

DIR = "observability"
PROFILE = "observability"
RULES = "config/prometheus/alerts.yml"
DASHBOARD = "config/grafana/pd-appliance.json"


def prometheus_config(cfg: HostConfig, proxy_addr: str) -> str:
    """This node's scrape config (JSON, which is YAML)."""
    targets = {"proxy": host_port(proxy_addr, cfg.ports.proxy),
               "prefill": host_port(cfg.host.ip, cfg.ports.prefill),
               "decode": host_port(cfg.host.ip, cfg.ports.decode)}
    doc = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [{"job_name": f"pd-{role}", "static_configs": [
            {"targets": [target], "labels": {"pd_role": role}}]}
            for role, target in targets.items()],
    }
    return "# Written by `pdctl render`: this node's scrape config.\n" + json.dumps(doc, indent=2)


def grafana_datasource(cfg: HostConfig) -> str:
    url = f"http://{host_port(cfg.observability.listen, cfg.observability.prometheus_port)}"
    return json.dumps({"apiVersion": 1, "datasources": [
        {"name": "Prometheus", "uid": "pd-prometheus", "type": "prometheus", "access": "proxy",
         "url": url, "isDefault": True}]}, indent=2)


def grafana_dashboards() -> str:
    return json.dumps({"apiVersion": 1, "providers": [
        {"name": "pd-appliance", "type": "file", "disableDeletion": True,
         "options": {"path": "/etc/grafana/provisioning/dashboards"}}]}, indent=2)


def files(cfg: HostConfig, proxy_addr: str, shipped: dict[str, Path]) -> dict[str, str]:
    """Path under DIR -> text. `shipped`: the source tree's rules and dashboard."""
    return {
        "prometheus/prometheus.yml": prometheus_config(cfg, proxy_addr),
        "prometheus/alerts.yml": shipped[RULES].read_text(),
        "grafana/datasources/prometheus.yaml": grafana_datasource(cfg),
        "grafana/dashboards/pd-appliance.yaml": grafana_dashboards(),
        "grafana/dashboards/pd-appliance.json": shipped[DASHBOARD].read_text(),
    }


def env(cfg: HostConfig) -> dict[str, str]:
    o = cfg.observability
    return {"COMPOSE_PROFILES": PROFILE if o.enabled else "",
            "PD_OBSERVABILITY_LISTEN": o.listen,
            "PD_PROMETHEUS_PORT": str(o.prometheus_port),
            "PD_GRAFANA_PORT": str(o.grafana_port),
            "PD_PROMETHEUS_IMAGE": o.prometheus_image,
            "PD_GRAFANA_IMAGE": o.grafana_image}
