"""A real Prometheus (Debian's `prometheus` package: its binaries, unpacked into the test
cache, never installed as a service) started on 127.0.0.1 by the tests that need it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "config" / "prometheus" / "alerts.yml"


def _cache() -> Path:
    return Path(os.environ.get("PD_TEST_CACHE") or Path.home() / ".cache/pd-appliance-tests")


def _unpack(into: Path) -> None:
    """`apt-get download` (no install: no service starts, nothing changes on the host) and
    the package's files unpacked under `into`."""
    with tempfile.TemporaryDirectory() as tmp:
        def download() -> subprocess.CompletedProcess[str]:
            return subprocess.run(["apt-get", "download", "prometheus"], cwd=tmp,
                                  capture_output=True, text=True, timeout=600)
        res = download()
        if res.returncode != 0 and os.geteuid() == 0:  # no package lists yet
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
            res = download()
        if res.returncode != 0:
            pytest.skip(f"cannot download Debian's prometheus package: {res.stderr.strip()}")
        (deb,) = Path(tmp).glob("prometheus_*.deb")
        staging = into.with_name(into.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, timeout=300)
        staging.rename(into)


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """The directory holding `prometheus` and `promtool`."""
    found = shutil.which("promtool")
    if found and shutil.which("prometheus"):
        return Path(found).parent
    root = _cache() / "prometheus-deb"
    if not (root / "usr" / "bin" / "promtool").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        _unpack(root)
    return root / "usr" / "bin"


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as r:
            return json.load(r)

    def query(self, expr: str) -> list[dict]:
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self) -> dict[str, str]:
        """alertname -> state (pending, firing) of every active alert."""
        return {a["labels"]["alertname"]: a["state"]
                for a in self.get("/api/v1/alerts")["data"]["alerts"]}


@contextmanager
def running_prometheus(bin_dir: Path, workdir: Path,
                       targets: dict[str, list[str]]) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 scraping `targets` ({pd_role: ["host:port"]}) every second
    with the shipped alert rules, stopped by its pid afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(RULES, workdir / "alerts.yml")
    scrape = [{"job_name": f"pd-{role}", "static_configs": [
        {"targets": hosts, "labels": {"pd_role": role}}]} for role, hosts in targets.items()]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": ["alerts.yml"], "scrape_configs": scrape}
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [str(bin_dir / "prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--storage.tsdb.retention.time=1h"], stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "Prometheus did not become ready"
                time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
