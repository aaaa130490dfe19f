"""The chart's CPU stack on a real Kubernetes node (node.py: kubelet, kube-proxy, containerd,
in namespaces of their own) joined to a real control plane (controlplane.py), with the
images the container test builds (tests/containers/engine.py) and the tiny model as a
hostPath:

- a plain pod runs, goes Ready through its probe and answers through its ClusterIP;
- `helm install` of the CPU stack (one P, one D, one proxy): every pod Running and Ready
  through the chart's own probes, the proxy finding P and D through its service account;
- greedy completions through the proxy's Service (its ClusterIP, through kube-proxy, from
  inside the node) equal a plain vLLM server's token for token, and D's
  vllm:pd_kv_received_total counts one KV transfer from P per request the proxy placed
  remote (the chart's split is auto);
- afterwards nothing is left: no process, mount, namespace or cgroup, and the host's
  iptables, links and sysctls as they were.

No cluster DNS runs: the test and the proxy use ClusterIPs and pod IPs."""

from __future__ import annotations

import time

import pytest

from tests.containers.test_compose_cpu import answer, requests_to_check
from tests.e2e.observe import calibrated, metric, received_for_each_remote, remote_decisions
from tests.k8s.conftest import (
    NS,
    RELEASE,
    SLIM,
    failure_report,
    http_get,
    is_ready,
    list_pods,
    until,
)
from tests.k8s.node import POD_CIDR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


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
        until("the plain pod Ready", lambda: all(map(is_ready, list_pods(cp, "app=plain"))),
              120,
               why=failure_report(cluster, "app=plain"))
        cluster["timings"]["plain pod Ready"] = time.monotonic() - begin
        url = f"http://127.0.0.1:{node.forward(svc['spec']['clusterIP'], 80)}/"
        assert "Directory listing" in until("an answer through the ClusterIP",
                                             lambda: http_get(url), 30)
    finally:
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/services/plain")
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/plain?gracePeriodSeconds=0")


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
    until("the proxy's Service answering", lambda: http_get(proxy + "/ready") is not None, 60)
    # The chart's split is auto, timed at start through the whole split: P's KV crossed
    # between the pods before any client asked.
    assert calibrated(proxy)["handoff"]["samples"] >= 1
    before = metric(decode, "vllm:pd_kv_received_total")
    assert before >= 4
    remote = remote_decisions(proxy)
    got = [answer(proxy, path, body) for path, body in requests_to_check()]
    assert got == expected
    # D used P's KV for each request the proxy then placed remote.
    received_for_each_remote(decode, before, remote_decisions(proxy) - remote)
