"""The chart's monitoring objects, each behind its value: a PodMonitor that scrapes P, D and
the proxy with the pd_role label the rules and the dashboard select on, the appliance's
alert rules as a PrometheusRule, and the Grafana dashboard as a ConfigMap (both the very
files of config/prometheus/ and config/grafana/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.charts.cases import NEEDED
from tests.charts.helmtool import Helm

ROOT = Path(__file__).resolve().parents[2]
ON = {"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                     "prometheusRule": {"enabled": True},
                     "dashboard": {"enabled": True}}}


def _kinds(helm: Helm, values: dict) -> dict[str, dict]:
    res = helm.template({**NEEDED, **values})
    assert res.rc == 0, res.out
    return {d["kind"]: d for d in res.docs()}


def test_off_by_default(helm: Helm) -> None:
    kinds = _kinds(helm, {})
    assert not {"PodMonitor", "PrometheusRule"} & set(kinds)
    assert not any(d["metadata"]["name"].endswith("-dashboard") for d in
                   helm.template(NEEDED).docs() if d["kind"] == "ConfigMap")


def test_each_object_when_asked(helm: Helm) -> None:
    kinds = _kinds(helm, ON)
    monitor = kinds["PodMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    exprs = {e["key"]: e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]}
    assert exprs["app.kubernetes.io/component"] == ["prefill", "decode", "proxy"]
    assert exprs["app.kubernetes.io/instance"] == ["pd"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["relabelings"][0]["targetLabel"] == "pd_role"
    # Every pod it selects names its metrics port `http`.
    for d in helm.template(NEEDED).docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            ports = [p["name"] for c in d["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", ())]
            assert "http" in ports, d["metadata"]["name"]
    rules = yaml.safe_load((ROOT / "config" / "prometheus" / "alerts.yml").read_text())
    assert kinds["PrometheusRule"]["spec"] == rules
    (board,) = [d for d in helm.template({**NEEDED, **ON}).docs()
                if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["pd-appliance.json"]) == json.loads(
        (ROOT / "config" / "grafana" / "pd-appliance.json").read_text())


@pytest.mark.parametrize("bad", [{"podMonitor": {"enabled": True, "interval": "often"}},
                                 {"dashboard": {"enabled": "yes"}},
                                 {"prometheusRule": {"enabeld": True}}])
def test_bad_monitoring_values_are_refused(helm: Helm, bad: dict) -> None:
    res = helm.template({**NEEDED, "monitoring": bad})
    assert res.rc != 0 and "values don't meet the specifications" in res.out, res.out
