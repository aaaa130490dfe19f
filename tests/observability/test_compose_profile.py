"""compose's `observability` profile (appliance.pdctl.node.observability): what `pdctl render`
writes for it passes promtool and Compose's own check, scrapes this node's proxy, P and D
by the labels the rules and the dashboard select on, provisions Grafana with that
Prometheus and the dashboard, and is on only when the host config says so. (The profile's
images cannot be pulled here; Debian's promtool checks what prom/prometheus would read.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from appliance.pdctl.config.hostconfig import parse_config, read_toml
from appliance.pdctl.errors import ConfigError
from appliance.pdctl.node.render import render
from tests.pdctl.conftest import GOOD_TOML
from tests.pdctl.test_render import resolved

ENABLED = GOOD_TOML + "\n[observability]\nenabled = true\nlisten = \"10.0.0.11\"\n"


def _render(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "etc" / "host.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    render(parse_config(read_toml(path, "")), path, path.parent)
    return path.parent


def test_the_profile_is_on_only_when_asked(tmp_path: Path) -> None:
    on = resolved(_render(tmp_path / "on", ENABLED))["services"]
    assert {"prometheus", "grafana"} <= set(on)
    off = resolved(_render(tmp_path / "off", GOOD_TOML))["services"]
    assert set(off) == {"bootstrap", "prefill", "decode", "proxy"}
    prom, graf = on["prometheus"], on["grafana"]
    assert prom["network_mode"] == graf["network_mode"] == "host"
    assert "--web.listen-address=10.0.0.11:9090" in prom["command"]
    assert graf["environment"]["GF_SERVER_HTTP_ADDR"] == "10.0.0.11"
    out = tmp_path / "on" / "etc"
    mounts = {v["target"]: v["source"] for v in prom["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/prometheus"] == str(out / "observability" / "prometheus")
    mounts = {v["target"]: v["source"] for v in graf["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == str(out / "observability" / "grafana")


def test_rendered_files_pass_promtool_and_name_this_node(tmp_path: Path,
                                                          prometheus_bin: Path) -> None:
    out = _render(tmp_path, ENABLED) / "observability"
    prom = out / "prometheus"
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml")):
        res = subprocess.run([str(prometheus_bin / "promtool"), *args], cwd=prom,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
    config = yaml.safe_load((prom / "prometheus.yml").read_text())
    targets = {c["static_configs"][0]["labels"]["pd_role"]: c["static_configs"][0]["targets"]
               for c in config["scrape_configs"]}
    assert targets == {"proxy": ["127.0.0.1:8000"], "prefill": ["10.0.0.11:8010"],
                       "decode": ["10.0.0.11:8020"]}
    source = yaml.safe_load((out / "grafana/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://10.0.0.11:9090"
    assert source["datasources"][0]["isDefault"] is True
    board = json.loads((out / "grafana/dashboards/pd-appliance.json").read_text())
    assert board["templating"]["list"][0]["type"] == "datasource"  # picks the default one
    provider = yaml.safe_load((out / "grafana/dashboards/pd-appliance.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/provisioning/dashboards"


def test_a_bad_listen_address_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"observability.listen: 'anywhere' is not an IP"):
        parse_config({**tomllib.loads(GOOD_TOML), "observability": {"listen": "anywhere"}})


def test_shipped_rules_and_dashboard_are_copied_as_they_are(tmp_path: Path) -> None:
    out = _render(tmp_path, GOOD_TOML) / "observability"
    root = Path(__file__).resolve().parents[2]
    for rendered, shipped in (("prometheus/alerts.yml", "config/prometheus/alerts.yml"),
                              ("grafana/dashboards/pd-appliance.json",
                               "config/grafana/pd-appliance.json")):
        assert (out / rendered).read_text() == (root / shipped).read_text()
