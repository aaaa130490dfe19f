"""The shipped Prometheus rules and scrape config pass promtool (and the rules' unit tests,
in Prometheus' virtual time); the Grafana dashboard is what its code builds; and a real
Prometheus, scraping a proxy, fires the P-down alert when its only P goes down and
resolves it when P is back. Every dashboard query against a loaded real node:
tests/e2e/test_pd_prometheus.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from appliance.observability import dashboard
from tests.observability.conftest import RULES, running_prometheus
from tests.proxy.conftest import MakeCluster, make_cluster  # noqa: F401 (a fixture)

HERE = Path(__file__).parent
CONFIG = RULES.parent / "prometheus.yml"


def _promtool(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "promtool"), *args], capture_output=True, text=True,
                          timeout=120, cwd=HERE)


def test_rules_and_config_pass_promtool(prometheus_bin: Path) -> None:
    for args in (("check", "rules", str(RULES)), ("check", "config", str(CONFIG)),
                 ("test", "rules", "alerts_test.yml")):
        res = _promtool(prometheus_bin, *args)
        assert res.returncode == 0, f"promtool {' '.join(args)}:\n{res.stdout}{res.stderr}"


def test_the_dashboard_is_what_its_code_builds() -> None:
    assert dashboard.OUT.read_text() == dashboard.render(), (
        "config/grafana/pd-appliance.json is stale: run "
        "python -m appliance.observability.dashboard")
    board = json.loads(dashboard.OUT.read_text())
    exprs = [[t["expr"] for t in p["targets"]] for p in board["panels"]]
    assert exprs == [[q.expr for q in p.queries] for p in dashboard.PANELS]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"])
    assert board["templating"]["list"][0]["type"] == "datasource"


async def test_p_down_fires_and_resolves(make_cluster: MakeCluster,  # noqa: F811
                                         prometheus_bin: Path, tmp_path: Path) -> None:
    c = await make_cluster()
    proxy = c.url.removeprefix("http://")
    with running_prometheus(prometheus_bin, tmp_path, {"proxy": [proxy]}) as prom:
        async def state(alert: str, want: str | None, within: float) -> None:
            for _ in range(int(within / 0.5)):
                if (await asyncio.to_thread(prom.alerts)).get(alert) == want:
                    return
                await asyncio.sleep(0.5)
            raise AssertionError(f"{alert} not {want} after {within} s: {prom.alerts()}")

        await asyncio.sleep(3)  # scraped while healthy: nothing pending
        assert "PDNoPrefillInRotation" not in await asyncio.to_thread(prom.alerts)
        c.prefill[0].healthy = False  # P's /health fails: the proxy takes it out
        await state("PDNoPrefillInRotation", "firing", within=40)  # `for: 15s`
        assert "PDNoDecodeInRotation" not in await asyncio.to_thread(prom.alerts)
        c.prefill[0].healthy = True
        await state("PDNoPrefillInRotation", None, within=20)
