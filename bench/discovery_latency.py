"""How long the proxy's Kubernetes discovery takes to notice a pod: marked Ready until the
proxy knows it, marked not Ready until it is gone, through a real API server's watch
(tests/k8s builds and runs the control plane; skipped where it cannot).

    .venv/bin/python bench/discovery_latency.py [--pods 10]

Also run by bench/xpyd.py."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from appliance.process import ServiceProcess  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.k8s.controlplane import (  # noqa: E402
    ControlPlaneUnavailable,
    control_plane,
    mark_ready,
)

NS = "bench"


def _known(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/status", timeout=3) as resp:
        status = json.load(resp)
    return {b["url"] for role in ("prefill", "decode") for b in status[role]
            if not b.get("leaving")}


def _wait(url: str, node: str, present: bool, timeout: float = 30) -> float:
    start = time.monotonic()
    while (node in _known(url)) is not present:
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{node} not {'added' if present else 'removed'} in {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


def run(pods: int = 10) -> Table | str:
    work = Path(tempfile.mkdtemp(prefix="pd-discovery-bench-"))
    try:
        with control_plane(work) as cp:
            cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": NS}})
            token = work / "token"
            token.write_text(cp.admin_token)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proxy = ServiceProcess("proxy", [
                sys.executable, "-m", "appliance.proxy", "--host", "127.0.0.1", "--port",
                str(port), "--discovery", "kubernetes", "--k8s-namespace", NS,
                "--k8s-api-server", cp.url, "--k8s-ca-file", str(cp.ca_file),
                "--k8s-token-file", str(token), "--k8s-prefill-selector", "role=prefill",
                "--k8s-decode-selector", "role=decode", "--no-log-requests"],
                work / "proxy.log", health_url=f"{url}/status", cwd=ROOT)
            proxy.start()
            try:
                proxy.wait_healthy(30)
                added, removed = [], []
                for i in range(pods):
                    name, ip = f"d{i}", f"127.0.11.{10 + i}"
                    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", {
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name, "labels": {"role": "decode"}},
                        "spec": {"nodeName": "n", "containers": [{"name": "c",
                                                                  "image": "x"}]}})
                    node = f"http://{ip}:8020"
                    mark_ready(cp, NS, name, ip)
                    added.append(_wait(url, node, True))
                    mark_ready(cp, NS, name, ip, ready=False)
                    removed.append(_wait(url, node, False))
                    cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}"
                                         f"?gracePeriodSeconds=0")
            finally:
                proxy.stop()
    except ControlPlaneUnavailable as exc:
        return f"discovery latency: skipped ({exc})"
    table = Table(title=f"Kubernetes discovery: {pods} pods, API server v1.20.2 on loopback "
                        f"(from the status change the API server accepted)")
    for col in ("change", "median ms", "max ms"):
        table.add_column(col, justify="right")
    for what, values in (("pod Ready -> known", added), ("pod not Ready -> gone", removed)):
        table.add_row(what, f"{statistics.median(values) * 1000:.0f}",
                      f"{max(values) * 1000:.0f}")
    return table


if __name__ == "__main__":
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=10)
    Console().print(run(ap.parse_args().pods))
