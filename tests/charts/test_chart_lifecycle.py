"""What keeps requests alive through rollouts, scale-downs and drains, in the rendered
objects: the proxy ready while it can answer, preStop waits on P, D and the proxy, vLLM's
--shutdown-timeout inside the grace period, rollout strategies, the pod network required,
and the keys' digest on every pod that mounts them."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.charts.cases import CASES, NEEDED, Rendered, merged
from tests.charts.objects import (
    Doc,
    container,
    flag,
    kv_config,
    of_kind,
    pod,
    proxy_settings,
    workload,
)
from tests.charts.test_chart_objects import DEFAULTS, ROLES, effective

EXIT_MARGIN_S = 10  # what the chart leaves vLLM to exit after draining


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, rendered: Rendered) -> tuple[str, list[Doc]]:
    return request.param, rendered(request.param)


def _pre_stop(c: Doc) -> list[str]:
    return c["lifecycle"]["preStop"]["exec"]["command"]


def test_vllm_drains_within_the_grace_period(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v = effective(name)
    for role in ROLES:
        w, r = workload(docs, role), v[role]
        grace = pod(w)["terminationGracePeriodSeconds"]
        assert grace == r["terminationGracePeriodSeconds"]
        c = container(w, "vllm")
        assert _pre_stop(c) == ["sleep", str(r["preStopSleepS"])]
        drain = int(flag(c["args"], "--shutdown-timeout"))
        assert drain == grace - r["preStopSleepS"] - EXIT_MARGIN_S
        assert drain >= 5  # the schema's bounds keep it so


def test_rollout_strategies(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v = effective(name)
    for component in (*ROLES, "proxy"):
        spec = workload(docs, component)["spec"]["strategy"]
        assert spec["type"] == "RollingUpdate"
        assert spec["rollingUpdate"] == v[component]["strategy"]
    if name == "defaults":  # nothing in flight is stopped before its replacement is Ready
        for component in (*ROLES, "proxy"):
            assert workload(docs, component)["spec"]["strategy"]["rollingUpdate"] == {
                "maxSurge": 1, "maxUnavailable": 0}
    if name == "no-surge":  # a cluster without a spare GPU: one pod at a time, PDB kept
        assert workload(docs, "decode")["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": 0, "maxUnavailable": "50%"}
        pdbs = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]
                for p in of_kind(docs, "PodDisruptionBudget")}
        assert pdbs["decode"]["maxUnavailable"] == 1


def test_the_proxy_is_ready_while_it_can_answer(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    p = effective(name)["proxy"]
    w = workload(docs, "proxy")
    c = container(w, "proxy")
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "httpGet" not in c["livenessProbe"]  # the listener alone, never the backends
    assert _pre_stop(c) == ["sleep", str(p["preStopSleepS"])]
    # preStop's sleep, then SIGTERM and the drain, then a margin
    assert pod(w)["terminationGracePeriodSeconds"] == p["preStopSleepS"] + p["drainGraceS"] + 15
    assert proxy_settings(docs)["drain_grace_s"] == p["drainGraceS"]


def test_a_slow_start_is_not_killed_by_liveness(case: tuple[str, list[Doc]]) -> None:
    """The proxy and the sidecar: a startupProbe on the listener, startupS long, holds
    liveness off (on a busy node a proxy took over 30 s to listen while a vLLM loaded, and
    liveness killed it in a loop: every rollout then cut requests)."""
    name, docs = case
    v = effective(name)
    for (component, cname), startup in (
            (("proxy", "proxy"), v["proxy"]["startupS"]),
            (("prefill", "bootstrap"), v["bootstrap"]["startupS"])):
        c = container(workload(docs, component), cname)
        probe = c["startupProbe"]
        assert "tcpSocket" in probe and probe["tcpSocket"]["port"] == c["livenessProbe"].get(
            "tcpSocket", c["livenessProbe"].get("httpGet", {})).get("port")
        assert probe["periodSeconds"] * probe["failureThreshold"] >= startup


def test_the_sidecar_outlives_vllm(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    v = effective(name)
    script = _pre_stop(container(workload(docs, "prefill"), "bootstrap"))
    assert script[:2] == ["python", "-c"]
    drain = int(flag(container(workload(docs, "prefill"), "vllm")["args"], "--shutdown-timeout"))
    assert f"time.sleep({v['prefill']['preStopSleepS']})" in script[2]
    assert f"time.monotonic() + {drain}" in script[2]
    assert f'(os.environ["POD_IP"], {v["ports"]["prefill"]})' in script[2]


def _sidecar_script(rendered: Rendered, port: int) -> str:
    values = merged(NEEDED, {"ports": {"prefill": port},
                             "prefill": {"preStopSleepS": 0,
                                         "terminationGracePeriodSeconds": 45}})
    result = rendered.values(values)
    assert result.rc == 0, result.out
    return _pre_stop(container(workload(result.docs(), "prefill"), "bootstrap"))[2]


def test_the_sidecar_prestop_waits_for_vllms_port_to_close(rendered: Rendered) -> None:
    """Run as the kubelet would: it ends once nothing listens on vLLM's port any more."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    script = _sidecar_script(rendered, port)

    def accept_then_close() -> None:
        listener.settimeout(0.2)
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            try:
                listener.accept()[0].close()
            except OSError:
                pass
        listener.close()  # vLLM has drained and exited

    threading.Thread(target=accept_then_close, daemon=True).start()
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], env={"POD_IP": "127.0.0.1"},
                          timeout=30, capture_output=True, text=True)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert 1.0 < took < 10, took  # waited while vLLM listened, not its whole drain time


def test_bad_lifecycle_values_refused_by_the_schema(rendered: Rendered) -> None:
    for bad, word in (({"decode": {"terminationGracePeriodSeconds": 44}},
                       "decode.terminationGracePeriodSeconds: Must be greater than or equal to 45"),
                      ({"proxy": {"preStopSleepS": -1}}, "proxy.preStopSleepS"),
                      ({"prefill": {"strategy": {"maxSurge": "all", "maxUnavailable": 0}}},
                       "prefill.strategy.maxSurge")):
        result = rendered.values(merged(NEEDED, bad))
        assert result.rc != 0 and word in result.out, (bad, result.out)
    lowest = merged(NEEDED, {"decode": {"terminationGracePeriodSeconds": 45,
                                        "preStopSleepS": 30}})
    result = rendered.values(lowest)
    assert result.rc == 0, result.out
    assert flag(container(workload(result.docs(), "decode"), "vllm")["args"],
                "--shutdown-timeout") == "5"


def test_the_pod_network_is_required(rendered: Rendered) -> None:
    result = rendered.values({})
    assert result.rc != 0
    assert "podNetworkCidrs: empty" in result.out and "allowAnyBootstrap=true" in result.out
    docs = rendered("any-bootstrap")  # the explicit opt-in renders, with no network check
    extra = kv_config(workload(docs, "decode"))["kv_connector_extra_config"]
    assert "allowed_bootstrap_networks" not in extra


def _checksums(docs: list[Doc]) -> dict[str, Any]:
    return {w["metadata"]["labels"]["app.kubernetes.io/component"]:
            w["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/keys")
            for w in of_kind(docs, "Deployment")}


def test_every_pod_that_mounts_keys_carries_their_digest(rendered: Rendered) -> None:
    """helm template sees no cluster (lookup is empty): an existing Secret's digest is then
    of its name; the live data's digest is checked on a real API server (tests/k8s)."""
    default_secret = DEFAULTS["keys"]["existingSecret"]
    by_name = hashlib.sha256(f"secret:{default_secret}".encode()).hexdigest()
    assert _checksums(rendered("defaults")) == dict.fromkeys(("prefill", "decode", "proxy"),
                                                             by_name)
    other = _checksums(rendered("existing-secret"))
    assert len(set(other.values())) == 1 and by_name not in other.values()
    inline = _checksums(rendered("inline-keys"))
    assert len(set(inline.values())) == 1 and None not in inline.values()


def test_p_and_d_publish_kv_events_for_the_prefix_index(rendered: Rendered) -> None:
    """Bound on the pod IP at ports vLLM picks (never tcp://* at a fixed port), hashed
    as the proxy hashes; the proxy weighs them unless proxy.prefixIndex is off."""
    from appliance.process import KV_EVENTS_FLAGS

    for role in ROLES:
        args = container(workload(rendered("defaults"), role), "vllm")["args"]
        at = args.index("--kv-events-config")
        assert args[at - 2:at + 2] == list(KV_EVENTS_FLAGS)
    assert proxy_settings(rendered("defaults"))["prefix_index"] is True
    off = rendered.values(merged(NEEDED, {"proxy": {"prefixIndex": False}}))
    assert off.rc == 0, off.out
    assert proxy_settings(off.docs())["prefix_index"] is False
    bad = rendered.values(merged(NEEDED, {"model": {"extraArgs": ["--kv-events-config={}"]}}))
    assert bad.rc != 0 and "proxy.prefixIndex" in bad.out
