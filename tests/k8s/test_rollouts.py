"""Ordinary Kubernetes operations on the chart's CPU stack cost no request, on the real node
(conftest.py: the release test_chart_on_a_real_node.py installed), each under a bounded
request loop through the proxy's Service (requestloop.py: streams and JSON, every answer
equal to a plain server's token for token):

- a P pod deleted: the proxy stays Ready and answers from D alone until the new P is Ready;
- `helm upgrade` changing P's and D's pod templates (the chart's maxSurge 1,
  maxUnavailable 0): zero failed requests;
- with two proxy replicas, the proxy rolled (while a second D comes up): no refused
  connection;
- with two D replicas, a D pod deleted: zero failed requests.

A failed request fails its scenario with the pods' timeline around it and the logs of the
pods that were stopping.

Each scenario prints requests sent, failed and the worst added latency (the table in the
closing note of the work that added it)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator

import pytest

from tests.containers.test_compose_cpu import requests_to_check
from tests.k8s.conftest import NS, RELEASE, chart_values, helm, is_ready, list_pods, until
from tests.k8s.requestloop import Outcome, RequestLoop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

RESULTS: dict[str, Outcome] = {}


def _selector(component: str) -> str:
    return f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"


@pytest.fixture(scope="module")
def release(cluster, installed, tiny_model, expected) -> Iterator[dict]:
    node, cp = cluster["node"], cluster["cp"]
    svc = cp.request("GET", f"/api/v1/namespaces/{NS}/services/{RELEASE}-pd-appliance-proxy")
    port = node.forward(svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"])
    proxy = f"http://127.0.0.1:{port}"
    requests = [(path, body, want) for (path, body), want
                in zip(requests_to_check(), expected, strict=True)]
    state = {"cluster": cluster, "proxy": proxy, "requests": requests,
             "values": chart_values(tiny_model)}
    yield state
    print("\nrollouts: scenario | sent | failed | worst added latency")
    for name, out in RESULTS.items():
        print(f"rollouts: {name} | {out.sent} | {out.failed} | {out.worst_added_s:.2f} s")


def _upgrade(release: dict, change: Callable[[dict], None]) -> None:
    values = copy.deepcopy(release["values"])
    change(values)
    helm(release["cluster"], "upgrade", values)
    release["values"] = values


def _settled(cp, component: str, replicas: int) -> Callable[[], bool]:
    """Exactly `replicas` pods of the component, all Ready and none terminating, all of the
    Deployment's current template."""
    def check() -> bool:
        pods = list_pods(cp, _selector(component))
        deps = cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments?labelSelector="
                                 f"{_selector(component)}")["items"]
        if len(deps) != 1:
            return False
        st, meta = deps[0].get("status") or {}, deps[0]["metadata"]
        return (st.get("observedGeneration", 0) >= meta["generation"]
                and st.get("updatedReplicas") == st.get("readyReplicas") == replicas
                and st.get("replicas") == replicas and len(pods) == replicas
                and all(is_ready(p) and not p["metadata"].get("deletionTimestamp")
                        for p in pods))
    return check


class _Timeline:
    """What the release's pods did, polled (phase, ready, deleting, container restarts),
    with each pod's log while it terminates (kubelet drops a deleted pod's logs): for a
    failed request, the moment it failed among them."""

    def __init__(self, release: dict) -> None:
        self.node, self.cp = release["cluster"]["node"], release["cluster"]["cp"]
        self.begin = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.states: dict[str, str] = {}
        self.logs: dict[str, str] = {}

    def poll(self) -> None:
        now, seen = time.monotonic() - self.begin, {}
        for p in list_pods(self.cp, f"app.kubernetes.io/instance={RELEASE}"):
            name, deleting = p["metadata"]["name"], bool(p["metadata"].get("deletionTimestamp"))
            restarts = sum(c.get("restartCount", 0)
                           for c in p["status"].get("containerStatuses") or ())
            seen[name] = (f"{p['status'].get('phase')} ready={is_ready(p)} "
                          f"deleting={deleting} restarts={restarts}")
            if deleting:
                for c in p["spec"]["containers"]:
                    got = self.node.pod_log(NS, name, c["name"])
                    if got:
                        self.logs[f"{name}/{c['name']}"] = got
        for name in seen.keys() | self.states.keys():
            state = seen.get(name, "gone")
            if self.states.get(name) != state:
                self.events.append((now, f"{name}: {state}"))
                self.states[name] = state
        self.states = {k: v for k, v in self.states.items() if v != "gone"}

    def report(self, out: Outcome) -> str:
        merged = sorted(self.events + [(t - self.begin, f"FAILED {f}") for t, f
                                       in zip(out.failed_at, out.failures, strict=True)])
        lines = [f"{t:7.1f} s  {what}" for t, what in merged]
        logs = {**self._current_logs(), **self.logs}
        for rid in filter(None, out.failed_ids):
            lines.append(f"--- what the pods logged about {rid}:")
            lines += [f"{name}: {line}" for name, log in logs.items()
                      for line in log.splitlines() if rid in line]
        for name, log in self.logs.items():
            lines.append(f"--- {name} (its last lines):\n{log[-3000:]}")
        return "\n".join(lines)

    def _current_logs(self) -> dict[str, str]:
        """Every container's log of the release's pods now (the proxy's access lines name
        each request id)."""
        got = {}
        for p in list_pods(self.cp, f"app.kubernetes.io/instance={RELEASE}"):
            name = p["metadata"]["name"]
            for c in p["spec"]["containers"]:
                got[f"{name}/{c['name']}"] = self.node.pod_log(NS, name, c["name"])
        return got


def _run(release: dict, name: str, event: Callable[[], None],
         done: Callable[[], bool], watch: Callable[[], None] = lambda: None) -> Outcome:
    """The request loop, warm first; then the event, then until `done` (and the loop a few
    seconds more, past the last pod's exit). A failed request fails the test with the pods'
    timeline around it."""
    with RequestLoop(release["proxy"], release["requests"]) as loop:
        loop.wait_answers(10)
        timeline = _Timeline(release)
        event()

        def finished() -> bool:
            timeline.poll()
            watch()
            return done()

        until(f"{name}: settled", finished, 600, 1.0,
              lambda: "\n".join(f"{t:7.1f} s  {e}" for t, e in timeline.events))
        for _ in range(3):
            time.sleep(1)
            timeline.poll()
        took = time.monotonic() - timeline.begin
    RESULTS[name] = out = loop.outcome
    print(f"\n{name}: {out.sent} sent, {out.failed} failed, worst added latency "
          f"{out.worst_added_s:.2f} s over {took:.0f} s")
    assert out.failed == 0, f"{out.failed} failed:\n{timeline.report(out)}"
    return out


def test_a_deleted_p_costs_nothing_the_proxy_answers_from_d_alone(release):
    cp = release["cluster"]["cp"]
    old = list_pods(cp, _selector("prefill"))
    assert len(old) == 1
    proxy_unready, no_p_ready = [], []

    def watch() -> None:
        proxies = list_pods(cp, _selector("proxy"))
        if not all(map(is_ready, proxies)):
            proxy_unready.append(time.monotonic())
        if not any(is_ready(p) and not p["metadata"].get("deletionTimestamp")
                   for p in list_pods(cp, _selector("prefill"))):
            no_p_ready.append(time.monotonic())

    name = old[0]["metadata"]["name"]

    def gone_and_back() -> bool:
        pods = list_pods(cp, _selector("prefill"))
        return all(p["metadata"]["name"] != name for p in pods) and \
            _settled(cp, "prefill", 1)()

    _run(release, "P pod deleted", lambda: cp.request(
        "DELETE", f"/api/v1/namespaces/{NS}/pods/{name}"), gone_and_back, watch)
    assert no_p_ready, "the new P was Ready before the old one left: no window without P"
    assert not proxy_unready, "the proxy went NotReady while P was away"


def test_a_helm_upgrade_of_p_and_d_costs_nothing(release):
    cp = release["cluster"]["cp"]
    before = {p["metadata"]["name"] for role in ("prefill", "decode")
              for p in list_pods(cp, _selector(role))}

    def change(v: dict) -> None:
        for role in ("prefill", "decode"):
            v[role]["podAnnotations"] = {"rollout": "upgrade-1"}

    def rolled() -> bool:
        now = {p["metadata"]["name"] for role in ("prefill", "decode")
               for p in list_pods(cp, _selector(role))}
        return not now & before and _settled(cp, "prefill", 1)() and \
            _settled(cp, "decode", 1)()

    _run(release, "helm upgrade of P and D", lambda: _upgrade(release, change), rolled)


def _two_d(v: dict) -> None:
    v["decode"]["replicas"] = 2


def test_rolling_two_proxies_refuses_no_connection(release):
    """Two proxies rolled while a second D comes up (scaling D out under load is as ordinary,
    and its start overlaps the roll rather than adding a minute to the run)."""
    cp = release["cluster"]["cp"]

    def two(v: dict) -> None:
        v["proxy"]["replicas"] = 2

    _upgrade(release, two)
    until("two proxies Ready", _settled(cp, "proxy", 2), 120)
    before = {p["metadata"]["name"] for p in list_pods(cp, _selector("proxy"))}

    def change(v: dict) -> None:
        v["proxy"]["podAnnotations"] = {"rollout": "proxy-1"}
        _two_d(v)

    def rolled() -> bool:
        now = {p["metadata"]["name"] for p in list_pods(cp, _selector("proxy"))}
        return not now & before and _settled(cp, "proxy", 2)() and _settled(cp, "decode", 2)()

    _run(release, "proxy rolled (2 replicas), a second D up",
         lambda: _upgrade(release, change), rolled)


def test_a_deleted_d_of_two_costs_nothing(release):
    cp = release["cluster"]["cp"]
    if release["values"]["decode"]["replicas"] != 2:  # run on its own
        _upgrade(release, _two_d)
    until("two D Ready", _settled(cp, "decode", 2), 600)
    name = list_pods(cp, _selector("decode"))[0]["metadata"]["name"]

    def gone() -> bool:
        # Until the deleted pod has drained and gone; its replacement's start is a D coming
        # into rotation, which the proxy roll above covers (and would add a vLLM start).
        pods = list_pods(cp, _selector("decode"))
        return all(p["metadata"]["name"] != name for p in pods) and any(map(is_ready, pods))

    _run(release, "D pod deleted (2 replicas)", lambda: cp.request(
        "DELETE", f"/api/v1/namespaces/{NS}/pods/{name}"), gone)
