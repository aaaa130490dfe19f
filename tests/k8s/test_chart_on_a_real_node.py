"""The chart's CPU stack on a real Kubernetes node (node.py: kubelet, kube-proxy, containerd,
in namespaces of their own) joined to a real control plane (controlplane.py), with the
images the container test builds (tests/containers/engine.py) and the tiny model as a
hostPath:

- a plain pod runs, goes Ready through its probe and answers through its ClusterIP;
- `helm install` of the CPU stack (one P, one D, one proxy): every pod Running and Ready
  through the chart's own probes, the proxy finding P and D through its service account;
- greedy completions through the proxy's Service (its ClusterIP, through kube-proxy, from
  inside the node) equal a plain vLLM server's token for token, and D's
  vllm:pd_kv_received_total counts one KV transfer from P per request;
- afterwards nothing is left: no process, mount, namespace or cgroup, and the host's
  iptables, links and sysctls as they were.

No cluster DNS runs: the test and the proxy use ClusterIPs and pod IPs."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from appliance import keys, kvbudget
from tests.charts.helmtool import find_helm
from tests.conftest import ROOT, running_plain_server
from tests.containers.engine import DockerEngine, EngineUnavailable, build_images, cache_dir
from tests.containers.engine import ensure_packages as ensure_docker
from tests.containers.test_compose_cpu import answer, requests_to_check
from tests.e2e.observe import metric
from tests.k8s.controlplane import ControlPlaneUnavailable, b64, control_plane
from tests.k8s.node import NODE_IP, PAUSE_IMAGE, POD_CIDR, NodeUnavailable, real_node
from tests.k8s.nodehost import host_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

NS = "pd-node"
RELEASE = "pd"
CHART = ROOT / "charts" / "pd-appliance"
TAG = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
VLLM, SLIM = f"pd-appliance/vllm-cpu:{TAG}", f"pd-appliance/slim:{TAG}"


def _until(what: str, check: Callable[[], Any], timeout: float, poll: float = 1.0,
           why: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{why()}")
        time.sleep(poll)


@pytest.fixture(scope="module")
def expected(tiny_model, tmp_path_factory):
    """A plain server's answers, taken before the node runs (two cores only)."""
    with running_plain_server(tiny_model, "tiny", tmp_path_factory.mktemp("plain")) as url:
        return [answer(url, path, body) for path, body in requests_to_check()]


@pytest.fixture(scope="module")
def cluster(expected, tmp_path_factory):
    helm, why = find_helm()
    if helm is None:
        pytest.skip(f"no helm: {why}")
    work = tmp_path_factory.mktemp("real-node")
    timings: dict[str, float] = {}
    try:
        ensure_docker(work / "apt.log")
        engine = DockerEngine(cache_dir() / "docker")
        engine.start()
    except EngineUnavailable as exc:
        pytest.skip(f"no Docker Engine for the images: {exc}")
    engine_left: list[str] = []
    try:
        build_images(engine, work / "build.log")
        before = host_state()
        with control_plane(work / "cp", advertise=NODE_IP, real_nodes=True) as cp:
            begin = time.monotonic()
            with real_node(cp, work / "node") as node:
                timings["node Ready"] = time.monotonic() - begin
                begin = time.monotonic()
                loaded = [image for image in (VLLM, SLIM) if node.load_image(engine, image)]
                timings[f"images loaded ({', '.join(loaded) or 'none: cached'})"] = \
                    time.monotonic() - begin
                node.keep_only([PAUSE_IMAGE, f"docker.io/{VLLM}", f"docker.io/{SLIM}"])
                engine_left = engine.stop()  # its memory back before vLLM starts
                yield {"cp": cp, "node": node, "helm": helm, "work": work,
                       "timings": timings}
        assert not node.left, f"the node left behind: {node.left}"
        assert host_state() == before
    except (ControlPlaneUnavailable, NodeUnavailable) as exc:
        pytest.skip(str(exc))
    finally:
        if engine.pid is not None:
            engine_left = engine.stop()
        assert not engine_left, f"the engine left behind: {engine_left}"
        print(f"\ntimings: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}")


def _pods(cp, selector: str) -> list[dict]:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")["items"]


def _ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod["status"].get("conditions") or [])


def _report(cluster: dict, selector: str) -> Callable[[], str]:
    """What went wrong, for a timeout: pod states, container logs, kubelet's last lines."""
    def why() -> str:
        node, out = cluster["node"], []
        for pod in _pods(cluster["cp"], selector):
            name = pod["metadata"]["name"]
            out.append(f"{name}: {pod['status'].get('phase')} "
                       f"{pod['status'].get('containerStatuses')}")
            for c in pod["spec"]["containers"]:
                out.append(f"--- {name}/{c['name']}:\n{node.pod_log(NS, name, c['name'])[-2000:]}")
        kubelet = (node.work / "kubelet.log").read_text(errors="replace")
        return "\n".join(out) + "\n--- kubelet:\n" + kubelet[-3000:]
    return why


@pytest.fixture(scope="module")
def namespace(cluster):
    cp = cluster["cp"]
    cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                             "metadata": {"name": NS}})
    node_keys = keys.ensure(cluster["work"] / "keys")
    cp.request("POST", f"/api/v1/namespaces/{NS}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pd-keys"},
        "data": {p.name: b64(p.read_text()) for p in sorted(node_keys.dir.iterdir())}})

    def default_account() -> bool:  # pods are refused until the controllers made it
        sas = cp.request("GET", f"/api/v1/namespaces/{NS}/serviceaccounts")["items"]
        return any(sa["metadata"]["name"] == "default" and sa.get("secrets") for sa in sas)

    _until("the default service account", default_account, 60, 0.3)
    return NS


def test_a_plain_pod_is_ready_and_answers_on_its_cluster_ip(cluster, namespace):
    cp, node = cluster["cp"], cluster["node"]
    labels = {"app": "plain"}
    probe = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "labels": labels},
        "spec": {"automountServiceAccountToken": False, "containers": [{
            "name": "web", "image": SLIM, "imagePullPolicy": "Never",
            "args": ["python", "-m", "http.server", "8080"], "workingDir": "/",
            "readinessProbe": probe}]}})
    svc = cp.request("POST", f"/api/v1/namespaces/{NS}/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "plain"},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]}})
    try:
        begin = time.monotonic()
        _until("the plain pod Ready", lambda: all(map(_ready, _pods(cp, "app=plain"))), 120,
               why=_report(cluster, "app=plain"))
        cluster["timings"]["plain pod Ready"] = time.monotonic() - begin
        url = f"http://127.0.0.1:{node.forward(svc['spec']['clusterIP'], 80)}/"
        assert "Directory listing" in _until("an answer through the ClusterIP",
                                             lambda: _get(url), 30)
    finally:
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/services/plain")
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/plain?gracePeriodSeconds=0")


def _get(url: str) -> str | None:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def _values(tiny_model: Path) -> dict:
    role = {"replicas": 1, "cpus": 1, "shmSize": "1Gi", "terminationGracePeriodSeconds": 45,
            "preStopSleepS": 2}
    # Two cores: P's and D's vLLM each get one (their requests fill the node), pinned to
    # a core of their own as on the container stack; the sidecar and proxy request none.
    # Eager, as the plain server that gives `expected` runs (an eager graph's greedy output
    # can differ from a compiled one's).
    none = {"requests": {"cpu": "0", "memory": "64Mi"}, "limits": {"memory": "1Gi"}}
    return {
        "stack": "cpu",
        "images": {"pullPolicy": "Never"},
        "model": {"path": "/models/tiny", "servedName": "tiny", "maxModelLen": 2048,
                  "kvCacheBytes": kvbudget.FLOOR, "extraArgs": ["--enforce-eager"],
                  "volume": {"type": "hostPath", "hostPath": str(tiny_model)}},
        "prefill": {**role, "extraEnv": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0"}]},
        "decode": {**role, "extraEnv": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "1"}]},
        "bootstrap": {"ttlS": 30, "resources": none},
        "proxy": {"replicas": 1, "resources": none, "preStopSleepS": 2, "drainGraceS": 5},
        "timeouts": {"startupS": 600},
        "podNetworkCidrs": [POD_CIDR],
        "keys": {"existingSecret": "pd-keys"},
    }


@pytest.fixture(scope="module")
def installed(cluster, namespace, tiny_model):
    cp, work = cluster["cp"], cluster["work"]
    (work / "values.yaml").write_text(yaml.safe_dump(_values(tiny_model)))
    begin = time.monotonic()
    res = subprocess.run(
        [str(cluster["helm"]), "install", RELEASE, str(CHART), "-n", NS, "--kubeconfig",
         str(cp.kubeconfig()), "-f", str(work / "values.yaml")],
        capture_output=True, text=True, timeout=120,
        env={"HOME": str(work), "PATH": "/usr/bin:/bin",
             **{f"HELM_{k}_HOME": str(work / f"helm-{k}") for k in ("CACHE", "CONFIG", "DATA")}})
    assert res.returncode == 0, res.stderr
    selector = f"app.kubernetes.io/instance={RELEASE}"

    def all_ready() -> list[dict] | None:
        cluster["node"].alive()
        pods = _pods(cp, selector)
        return pods if len(pods) == 3 and all(map(_ready, pods)) else None

    pods = _until("P, D and the proxy Ready", all_ready, 900, 2, _report(cluster, selector))
    cluster["timings"]["helm install to all Ready"] = time.monotonic() - begin
    return {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in pods}


def test_every_pod_runs_and_is_ready_through_the_charts_probes(installed):
    assert set(installed) == {"prefill", "decode", "proxy"}
    for component, pod in installed.items():
        statuses = pod["status"]["containerStatuses"]
        want = {"prefill": {"vllm", "bootstrap"}, "decode": {"vllm"}, "proxy": {"proxy"}}
        assert {s["name"] for s in statuses} == want[component]
        for s in statuses:
            assert s["ready"] and "running" in s["state"], (component, s)
            assert s["image"].startswith("docker.io/pd-appliance/"), s["image"]
        for c in pod["spec"]["containers"]:  # what kubelet probed: the chart's own
            assert c["readinessProbe"] and c["livenessProbe"], (component, c["name"])
        assert pod["status"]["podIP"].startswith(POD_CIDR.rsplit(".", 2)[0])


def test_greedy_output_through_the_proxy_service_equals_a_plain_server(cluster, installed,
                                                                       expected):
    cp, node = cluster["cp"], cluster["node"]
    svc = cp.request("GET", f"/api/v1/namespaces/{NS}/services/{RELEASE}-pd-appliance-proxy")
    port = svc["spec"]["ports"][0]["port"]
    proxy = f"http://127.0.0.1:{node.forward(svc['spec']['clusterIP'], port)}"
    decode = f"http://127.0.0.1:{node.forward(installed['decode']['status']['podIP'], 8020)}"
    _until("the proxy's Service answering", lambda: _get(proxy + "/ready") is not None, 60)
    before = metric(decode, "vllm:pd_kv_received_total")
    got = [answer(proxy, path, body) for path, body in requests_to_check()]
    assert got == expected
    # D used P's KV: one transfer per request.
    assert metric(decode, "vllm:pd_kv_received_total") - before == len(expected)
