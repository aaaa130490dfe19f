"""The chart on a real Kubernetes API server (v1.20.2 with its scheduler and controller
manager, see controlplane.py), fake GPU nodes, and the proxy's discovery through the chart's
own service account and Role:

- `helm install` creates every object; P and D pods are placed by role across the nodes
  (topology spread) with their GPU requests, and what exceeds the nodes' GPUs stays Pending;
- Services get endpoints once pods are marked Ready;
- the proxy, started with the arguments of the chart's proxy Deployment, sees the Ready
  pods, and sees them come and go (not Ready, deleted and replaced) without a restart;
- rotating the data of keys.existingSecret and `helm upgrade` changes the pod template of
  every Deployment that mounts the keys (a rollout), and an upgrade without it changes none."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from appliance import keys
from appliance.process import ServiceProcess
from tests.charts.helmtool import find_helm
from tests.conftest import ROOT, free_port
from tests.k8s.controlplane import (
    ControlPlaneUnavailable,
    b64,
    control_plane,
    fake_node,
    mark_ready,
    until,
)

pytestmark = pytest.mark.slow

NS = "pd-test"
RELEASE = "pd"
SA = f"{RELEASE}-pd-appliance-proxy"
CHART = ROOT / "charts" / "pd-appliance"
SELECT = f"app.kubernetes.io/instance={RELEASE}"


def _values(decode_replicas: int) -> dict:
    spread = {"enabled": True, "maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}
    return {
        "model": {"path": "/models/m", "prefillTpSize": 2, "decodeTpSize": 4,
                  "volume": {"type": "hostPath", "hostPath": "/models/m"}},
        "prefill": {"replicas": 2, "topologySpread": spread},
        "decode": {"replicas": decode_replicas, "topologySpread": spread},
        "podNetworkCidrs": ["127.0.10.0/24"],
        "keys": {"existingSecret": "pd-keys"},
    }


@pytest.fixture(scope="module")
def k8s(tmp_path_factory):
    helm, why = find_helm()
    if helm is None:
        pytest.skip(f"no helm: {why}")
    work = tmp_path_factory.mktemp("k8s")
    try:
        with control_plane(work, {f"system:serviceaccount:{NS}:{SA}":
                                  "system:serviceaccounts"}) as cp:
            cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": NS}})
            node_keys = keys.ensure(work / "keys")
            cp.request("POST", f"/api/v1/namespaces/{NS}/secrets", {
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pd-keys"},
                "data": {p.name: b64(p.read_text()) for p in sorted(node_keys.dir.iterdir())}})
            for name in ("gpu-a", "gpu-b"):
                # a GPU cluster as the Network Operator makes it: the chart asks for RDMA
                fake_node(cp, name, gpus=8, rdma={"rdma/rdma_shared_device_a": 63})
            yield cp, helm, work, node_keys
    except ControlPlaneUnavailable as exc:
        pytest.skip(str(exc))


def _helm(k8s, *args: str, values: dict | None = None) -> str:
    cp, helm, work, _ = k8s
    argv = [str(helm), *args, "--kubeconfig", str(cp.kubeconfig()), "-n", NS]
    if values is not None:
        path = work / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        argv += ["-f", str(path)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         env={"HOME": str(work), "PATH": "/usr/bin:/bin",
                              "HELM_CACHE_HOME": str(work / "helm-cache"),
                              "HELM_CONFIG_HOME": str(work / "helm-config"),
                              "HELM_DATA_HOME": str(work / "helm-data")})
    assert res.returncode == 0, res.stderr
    return res.stdout


def _pods(cp, component: str) -> list[dict]:
    sel = f"{SELECT},app.kubernetes.io/component={component}"
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={sel}")["items"]


def _gpus(pod: dict) -> int:
    return sum(int(c["resources"].get("requests", {}).get("nvidia.com/gpu", 0))
               for c in pod["spec"]["containers"])


@pytest.fixture(scope="module")
def installed(k8s):
    cp = k8s[0]
    _helm(k8s, "install", RELEASE, str(CHART), values=_values(decode_replicas=2))

    def placed() -> list[dict] | None:
        pods = _pods(cp, "prefill") + _pods(cp, "decode")
        ok = len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods)
        return pods if ok else None

    pods = until("4 pods scheduled", placed, 90)
    return pods


def test_pods_are_placed_by_role_across_the_nodes(k8s, installed):
    by_role: dict[str, Counter] = {"prefill": Counter(), "decode": Counter()}
    used: Counter = Counter()
    for pod in installed:
        role = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        by_role[role][pod["spec"]["nodeName"]] += 1
        used[pod["spec"]["nodeName"]] += _gpus(pod)
        assert _gpus(pod) == (2 if role == "prefill" else 4)
        # the GPU stack moves KV over RDMA by default, on the Network Operator's resource
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["rdma/rdma_shared_device_a"] == "1"
    # one P and one D per node: spread by role
    assert by_role["prefill"] == by_role["decode"] == Counter({"gpu-a": 1, "gpu-b": 1})
    assert all(n <= 8 for n in used.values())


def _proxy_argv(k8s, port: int, token_file: Path, tmp: Path) -> list[str]:
    """The chart's proxy arguments and config file (its ConfigMap), with this machine's API
    server, CA, token and keys."""
    cp, _helm_bin, work, node_keys = k8s
    name = f"{RELEASE}-pd-appliance-proxy"
    deployment = cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = [*container.get("command", []), *container.get("args", [])]
    args = args[args.index("appliance.proxy") + 1:]
    at = args.index("--config")
    config = cp.request("GET", f"/api/v1/namespaces/{NS}/configmaps/{name}")["data"][
        Path(args[at + 1]).name]
    local = tmp / "proxy.toml"
    local.write_text(config.replace("/etc/pd-appliance/keys", str(node_keys.dir)))
    args[at + 1] = str(local)
    return [sys.executable, "-m", "appliance.proxy", *args, "--host", "127.0.0.1",
            "--port", str(port), "--k8s-api-server", cp.url, "--k8s-ca-file",
            str(cp.ca_file), "--k8s-token-file", str(token_file), "--k8s-namespace", NS,
            "--health-interval", "0.5"]


def _known(url: str) -> dict[str, set[str]]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/status", timeout=3) as resp:
        status = json.load(resp)
    return {role: {b["url"] for b in status[role] if not b.get("leaving")}
            for role in ("prefill", "decode")}


def test_proxy_discovery_follows_the_pods(k8s, installed, tmp_path):
    cp = k8s[0]
    for i, pod in enumerate(_pods(cp, "prefill")):
        mark_ready(cp, NS, pod["metadata"]["name"], f"127.0.10.{11 + i}")
    for i, pod in enumerate(_pods(cp, "decode")):
        mark_ready(cp, NS, pod["metadata"]["name"], f"127.0.10.{21 + i}")
    token = tmp_path / "token"
    token.write_text(cp.tokens[f"system:serviceaccount:{NS}:{SA}"])
    port = free_port()
    proxy = ServiceProcess("proxy", _proxy_argv(k8s, port, token, tmp_path),
                           tmp_path / "proxy.log",
                           cwd=ROOT)
    proxy.start()
    url = f"http://127.0.0.1:{port}"
    try:
        want = {"prefill": {"http://127.0.10.11:8010", "http://127.0.10.12:8010"},
                "decode": {"http://127.0.10.21:8020", "http://127.0.10.22:8020"}}

        def sees(expected: dict[str, set[str]]):
            def check() -> bool:
                assert proxy.running, proxy.log_tail(30)
                try:
                    return _known(url) == expected
                except OSError:
                    return False
            return check

        until("the proxy sees the ready pods", sees(want))
        # a P pod no longer Ready leaves the proxy's set
        p0 = _pods(cp, "prefill")[0]["metadata"]["name"]
        start = time.monotonic()
        mark_ready(cp, NS, p0, "127.0.10.11", ready=False)
        until("not Ready P removed", sees({**want, "prefill": {"http://127.0.10.12:8010"}}))
        removed_s = time.monotonic() - start
        # a D pod deleted: its ReplicaSet makes another, scheduled; Ready with a new IP, it
        # replaces the old one
        d0_pod = _pods(cp, "decode")[0]
        d0 = d0_pod["metadata"]["name"]
        kept = want["decode"] - {f"http://{d0_pod['status']['podIP']}:8020"}
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{d0}?gracePeriodSeconds=0")

        def replacement() -> str | None:
            fresh = [p for p in _pods(cp, "decode") if p["metadata"]["name"] != d0
                     and p["spec"].get("nodeName") and not p["status"].get("podIP")]
            return fresh[0]["metadata"]["name"] if fresh else None

        new = until("a replacement D pod scheduled", replacement, 60)
        start = time.monotonic()
        mark_ready(cp, NS, new, "127.0.10.23")
        until("the deleted D replaced by the new one", sees(
            {"prefill": {"http://127.0.10.12:8010"},
             "decode": {*kept, "http://127.0.10.23:8020"}}))
        added_s = time.monotonic() - start
        print(f"discovery: a P not Ready left the proxy's set {removed_s:.2f} s after the "
              f"API server had it; a new D joined {added_s:.2f} s after")
    finally:
        proxy.stop()


def _endpoints(cp, service: str) -> tuple[set[str], set[str]] | None:
    """(ready, not ready) addresses of a Service's Endpoints; None before the endpoints
    controller has made the object."""
    import urllib.error

    try:
        got = cp.request("GET", f"/api/v1/namespaces/{NS}/endpoints/{service}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    subsets = got.get("subsets") or []
    return ({a["ip"] for s in subsets for a in s.get("addresses") or []},
            {a["ip"] for s in subsets for a in s.get("notReadyAddresses") or []})


def test_services_get_endpoints_once_pods_are_ready(k8s, installed):
    """New P pods (the old ones deleted: a pod's IP is set once) get Endpoints addresses
    once Ready, and lose them when not Ready. Endpoints refuse loopback addresses, so these
    pods get 10.244.0.x; nothing sends them traffic (the proxy has stopped)."""
    cp = k8s[0]
    service = f"{RELEASE}-pd-appliance-prefill"
    old = {p["metadata"]["name"] for p in _pods(cp, "prefill")}
    for name in old:
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0")

    def replaced() -> list[dict] | None:
        pods = _pods(cp, "prefill")
        fresh = [p for p in pods if p["metadata"]["name"] not in old
                 and p["spec"].get("nodeName")]
        return fresh if len(pods) == len(fresh) == 2 else None

    until("2 new P pods scheduled", replaced)
    before = until("the prefill Service's Endpoints", lambda: _endpoints(cp, service))
    assert before[0] == set()  # scheduled, but no pod is Ready: no address
    for i, pod in enumerate(_pods(cp, "prefill")):
        mark_ready(cp, NS, pod["metadata"]["name"], f"10.244.0.{11 + i}")
    assert until("prefill endpoints", lambda: (_endpoints(cp, service) or ((),))[0] == {
        "10.244.0.11", "10.244.0.12"})
    # not Ready again: the address leaves the ready set
    first = _pods(cp, "prefill")[0]["metadata"]["name"]
    mark_ready(cp, NS, first, "10.244.0.11", ready=False)
    assert until("a not-Ready pod's address withdrawn",
                  lambda: _endpoints(cp, service) == ({"10.244.0.12"}, {"10.244.0.11"}))


def test_what_exceeds_the_gpus_stays_pending(k8s, installed):
    cp = k8s[0]
    # 2 P of 2 GPUs and 4 D of 4 GPUs want 20; the nodes have 16
    _helm(k8s, "upgrade", RELEASE, str(CHART), values=_values(decode_replicas=4))

    def settled() -> list[dict] | None:
        pods = [p for p in _pods(cp, "decode") if not p["metadata"].get("deletionTimestamp")]
        pending = [p for p in pods if not p["spec"].get("nodeName")]
        unschedulable = [p for p in pending for c in p["status"].get("conditions") or []
                         if c.get("reason") == "Unschedulable"]
        return pods if len(pods) == 4 and unschedulable else None

    pods = until("an unschedulable D", settled, 90)
    used: Counter = Counter()
    for pod in _pods(cp, "prefill") + pods:
        if pod["spec"].get("nodeName"):
            used[pod["spec"]["nodeName"]] += _gpus(pod)
    assert all(n <= 8 for n in used.values()), used
    pending = [p for p in pods if not p["spec"].get("nodeName")]
    assert pending
    message = " ".join(c.get("message", "") for p in pending
                       for c in p["status"].get("conditions") or [])
    assert "nvidia.com/gpu" in message


def _keys_templates(cp, release: str) -> dict[str, tuple[str, int]]:
    """Each keys-mounting Deployment's keys digest and generation (bumped by a template
    change only)."""
    out = {}
    for component in ("prefill", "decode", "proxy"):
        d = cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/"
                              f"{release}-pd-appliance-{component}")
        annotations = d["spec"]["template"]["metadata"].get("annotations") or {}
        out[component] = (annotations.get("checksum/keys"), d["metadata"]["generation"])
    return out


def test_rotating_an_existing_secret_rolls_every_pod_that_reads_it(k8s, tmp_path):
    """A release of its own with no pods (replicas 0: it takes no GPU from the others);
    what a rollout needs is a changed pod template, and the controller's new ReplicaSet."""
    import hashlib

    cp = k8s[0]
    release, secret = "rot", "rot-keys"
    path = f"/api/v1/namespaces/{NS}/secrets"

    def secret_body(node_keys) -> dict:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret},
                "data": {p.name: b64(p.read_text()) for p in sorted(node_keys.dir.iterdir())}}

    cp.request("POST", path, secret_body(keys.ensure(tmp_path / "keys")))
    values = {**_values(decode_replicas=0), "prefill": {"replicas": 0},
              "proxy": {"replicas": 0}, "keys": {"existingSecret": secret}}
    _helm(k8s, "install", release, str(CHART), values=values)
    try:
        first = _keys_templates(cp, release)
        digests = {digest for digest, _ in first.values()}
        assert len(digests) == 1 and None not in digests
        # the Secret's data, not its name (what helm template, with no cluster, falls back to)
        assert digests != {hashlib.sha256(f"secret:{secret}".encode()).hexdigest()}
        _helm(k8s, "upgrade", release, str(CHART), values=values)
        assert _keys_templates(cp, release) == first  # same keys: no rollout
        rotated = keys.ensure(tmp_path / "keys", rotate=True)
        cp.request("PUT", f"{path}/{secret}", secret_body(rotated))
        _helm(k8s, "upgrade", release, str(CHART), values=values)
        after = _keys_templates(cp, release)
        for component, (digest, generation) in after.items():
            assert digest != first[component][0], component
            assert generation > first[component][1], component

        def new_replica_sets() -> bool:
            sel = f"app.kubernetes.io/instance={release}"
            sets = cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/replicasets"
                                     f"?labelSelector={sel}")["items"]
            per = Counter(rs["metadata"]["labels"]["app.kubernetes.io/component"]
                          for rs in sets)
            return per == Counter({"prefill": 2, "decode": 2, "proxy": 2})

        until("a new ReplicaSet per keys-mounting Deployment", new_replica_sets)
    finally:
        _helm(k8s, "uninstall", release)
        cp.request("DELETE", f"{path}/{secret}")
