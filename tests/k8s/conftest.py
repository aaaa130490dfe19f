"""What the real-node tests share (test_chart_on_a_real_node.py, test_rollouts.py): one
control plane, one real node (node.py) with the appliance's images, and one release of the
chart's CPU stack, brought up once for the package: each bring-up costs minutes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from appliance import keys, kvbudget
from tests.charts.helmtool import find_helm
from tests.conftest import ROOT, running_plain_server
from tests.containers.engine import DockerEngine, EngineUnavailable, build_images, cache_dir
from tests.containers.engine import ensure_packages as ensure_docker
from tests.containers.test_compose_cpu import answer, requests_to_check
from tests.k8s.controlplane import ControlPlaneUnavailable, b64, control_plane, until
from tests.k8s.node import NODE_IP, PAUSE_IMAGE, POD_CIDR, NodeUnavailable, real_node
from tests.k8s.nodehost import host_state

NS = "pd-node"
RELEASE = "pd"
CHART = ROOT / "charts" / "pd-appliance"
TAG = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
VLLM, SLIM = f"pd-appliance/vllm-cpu:{TAG}", f"pd-appliance/slim:{TAG}"


@pytest.fixture(scope="package")
def expected(tiny_model, tmp_path_factory):
    """A plain server's answers, taken before the node runs (two cores only)."""
    with running_plain_server(tiny_model, "tiny", tmp_path_factory.mktemp("plain")) as url:
        return [answer(url, path, body) for path, body in requests_to_check()]


@pytest.fixture(scope="package")
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


def list_pods(cp, selector: str) -> list[dict]:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")["items"]


def is_ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod["status"].get("conditions") or [])


def failure_report(cluster: dict, selector: str) -> Callable[[], str]:
    """What went wrong, for a timeout: pod states, container logs, kubelet's last lines."""
    def why() -> str:
        node, out = cluster["node"], []
        for pod in list_pods(cluster["cp"], selector):
            name = pod["metadata"]["name"]
            out.append(f"{name}: {pod['status'].get('phase')} "
                       f"{pod['status'].get('containerStatuses')}")
            for c in pod["spec"]["containers"]:
                out.append(f"--- {name}/{c['name']}:\n{node.pod_log(NS, name, c['name'])[-2000:]}")
        kubelet = (node.work / "kubelet.log").read_text(errors="replace")
        return "\n".join(out) + "\n--- kubelet:\n" + kubelet[-3000:]
    return why


@pytest.fixture(scope="package")
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

    until("the default service account", default_account, 60, 0.3)
    return NS


def http_get(url: str) -> str | None:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def chart_values(tiny_model: Path) -> dict:
    # cpuRequest: a rollout's surge pod (the chart's default maxSurge 1) must fit 2 cores.
    # preStopSleepS stays the chart's (5 s): the proxy must have dropped a deleted pod
    # before vLLM's SIGTERM, and a loaded node's watch can take seconds (with 2 s a helm
    # upgrade sent a request to a D whose engine had drained, and it hung until D exited).
    role = {"replicas": 1, "cpus": 1, "cpuRequest": "100m", "shmSize": "1Gi",
            "terminationGracePeriodSeconds": 45}
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
        # The proxy's preStop stays the chart's: its endpoints must leave kube-proxy's rules
        # before it stops listening (2 s was too short here: refused connections).
        # The proxy requests a share of CPU as P and D do (the chart's default is 500m): with
        # none it got ~1% of a core beside two vLLMs and took minutes to start.
        "proxy": {"replicas": 1, "drainGraceS": 5,
                  "resources": {**none, "requests": {"cpu": "100m", "memory": "64Mi"}}},
        "timeouts": {"startupS": 600},
        "podNetworkCidrs": [POD_CIDR],
        "keys": {"existingSecret": "pd-keys"},
    }


def helm(cluster: dict, verb: str, values: dict) -> None:
    """`helm install` or `helm upgrade` of the release with exactly these values."""
    work = cluster["work"]
    (work / "values.yaml").write_text(yaml.safe_dump(values))
    res = subprocess.run(
        [str(cluster["helm"]), verb, RELEASE, str(CHART), "-n", NS, "--kubeconfig",
         str(cluster["cp"].kubeconfig()), "-f", str(work / "values.yaml")],
        capture_output=True, text=True, timeout=120,
        env={"HOME": str(work), "PATH": "/usr/bin:/bin",
             **{f"HELM_{k}_HOME": str(work / f"helm-{k}") for k in ("CACHE", "CONFIG", "DATA")}})
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="package")
def installed(cluster, namespace, tiny_model):
    cp = cluster["cp"]
    begin = time.monotonic()
    helm(cluster, "install", chart_values(tiny_model))
    selector = f"app.kubernetes.io/instance={RELEASE}"

    def all_ready() -> list[dict] | None:
        cluster["node"].alive()
        pods = list_pods(cp, selector)
        return pods if len(pods) == 3 and all(map(is_ready, pods)) else None

    pods = until("P, D and the proxy Ready", all_ready, 900, 2,
                 failure_report(cluster, selector))
    cluster["timings"]["helm install to all Ready"] = time.monotonic() - begin
    return {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in pods}
