"""`pdctl status --cluster FILE` against a live cluster of stand-ins on two loopback
addresses ("hosts" a and b): the real bootstrap sidecar and proxy, fake vLLM P and D."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from appliance.bootstrap.app import build_app as bootstrap_app
from appliance.bootstrap.settings import BootstrapSettings
from appliance.pdctl.cluster.description import load_cluster
from appliance.proxy.server import build_app as proxy_app
from appliance.proxy.settings import load_settings
from tests.conftest import free_port
from tests.pdctl.servers import FakeVLLM, Servers, register


def _description(ports: dict[str, int]) -> str:
    return f"""\
stack = "cpu"
[model]
path = "/models/tiny"
[proxy]
host = "a"
[ports]
proxy = {ports["proxy"]}
prefill = {ports["prefill"]}
decode = {ports["decode"]}
bootstrap = {ports["bootstrap"]}
[[hosts]]
name = "a"
ip = "127.0.0.1"
cpus = 2
prefill = [[0]]
[[hosts]]
name = "b"
ip = "127.0.0.2"
cpus = 2
decode = [[0], [1]]
"""


@pytest.fixture
def cluster(tmp_path: Path):
    servers = Servers()
    while True:  # free ports are not reserved: one may come back twice
        ports = {name: free_port() for name in ("proxy", "prefill", "decode", "bootstrap")}
        # b's decode-0 and decode-1 take ports["decode"] and the next
        if len({*ports.values(), ports["decode"] + 1}) == 5:
            break
    path = tmp_path / "cluster.toml"
    path.write_text(_description(ports))
    plan = load_cluster(path).plan()
    p, d0, d1 = FakeVLLM("prefill"), FakeVLLM("decode"), FakeVLLM("decode")
    try:
        servers.tcp(p.app(), ports["prefill"], "127.0.0.1")
        servers.tcp(d0.app(), ports["decode"], "127.0.0.2")
        servers.tcp(d1.app(), ports["decode"] + 1, "127.0.0.2")
        boot = servers.tcp(bootstrap_app(BootstrapSettings(ttl=0)), ports["bootstrap"])
        register(boot, "a-prefill-0")
        settings = load_settings([*plan.proxy_args(), "--host", "127.0.0.1", "--port",
                                  str(ports["proxy"]), "--health-interval", "0.1"])
        servers.tcp(proxy_app(settings), ports["proxy"])
        yield path, d1, p
    finally:
        servers.close()


def _status(pdctl, path: Path, within: float = 10.0, healthy: bool = True):
    """pdctl status --cluster --json, until it says `healthy` (the proxy's checks settle)."""
    deadline = time.monotonic() + within
    while True:
        res = pdctl("status", "--cluster", str(path), "--json")
        out = json.loads(res.stdout)
        if out["healthy"] == healthy or time.monotonic() > deadline:
            return res, out
        time.sleep(0.1)


def test_the_whole_cluster_healthy(pdctl, cluster) -> None:
    path, *_ = cluster
    res, out = _status(pdctl, path)
    assert res.exit_code == 0, res.stdout
    assert [(m["name"], m["healthy"], m["in_rotation"]) for m in out["members"]] == [
        ("a/prefill-0", True, True), ("b/decode-0", True, True), ("b/decode-1", True, True),
        ("a/bootstrap", True, None), ("a/proxy", True, None)]
    assert out["members"][1]["url"].startswith("http://127.0.0.2:")
    assert out["split"] == {"policy": "auto", "last_minute": {"remote": 0, "local": 0,
                                                                   "p_alone": 0}}
    table = pdctl("status", "--cluster", str(path))
    assert "cluster healthy" in table.stdout and "b/decode-1" in table.stdout
    assert "proxy: split auto, last minute: 0 remote (P then D), 0 local" in table.stdout


def test_kv_counters_and_warnings_when_kv_did_not_move(pdctl, cluster) -> None:
    """D recomputes a prompt whose KV did not come, so answers stay right: the counters of
    refused side-channel messages and failed transfers are the only sign, shown as
    warnings (the exit code stays 0)."""
    path, _, p = cluster
    p.extra_metrics = ("# TYPE vllm:pd_side_channel_rejected counter\n"
                       'vllm:pd_side_channel_rejected_total{engine="0"} 10.0\n')
    res, out = _status(pdctl, path)
    assert res.exit_code == 0
    kv = {m["name"]: m["kv"] for m in out["members"]}
    assert kv["a/prefill-0"] == {"sent": 41, "refused": 10, "failed": 2}
    assert kv["b/decode-0"] == {"received": 40, "failed": 1}
    assert "a/prefill-0: refused 10 side-channel messages (its log says why: a D's " \
           "session address outside host.internal_networks, or a wrong key)" in out["warnings"]
    assert "b/decode-1: 1 KV transfers failed (D recomputed those prompts itself)" in \
        out["warnings"]
    table = pdctl("status", "--cluster", str(path)).stdout
    assert "warning: a/prefill-0: refused 10" in table and "received 40" in table


def test_an_unhealthy_instance_fails_the_cluster(pdctl, cluster) -> None:
    path, d1, _ = cluster
    _status(pdctl, path)
    d1.healthy = False
    res, out = _status(pdctl, path, healthy=False)
    assert res.exit_code == 1
    bad = [m for m in out["members"] if not m["healthy"]]
    assert [(m["name"], m["health"]) for m in bad] == [("b/decode-1", "HTTP 503")]


def test_an_instance_the_proxy_does_not_know_is_a_problem(pdctl, cluster, tmp_path) -> None:
    path, *_ = cluster
    text = path.read_text().replace('ip = "127.0.0.2"\ncpus = 2', 'ip = "127.0.0.2"\n'
                                    'cpus = 3\nprefill = [[2]]')  # not in the proxy's list
    other = tmp_path / "other.toml"
    other.write_text(text)
    res = pdctl("status", "--cluster", str(other), "--json")
    assert res.exit_code == 1
    problems = json.loads(res.stdout)["problems"]
    assert any(p.startswith("b/prefill-0: the proxy does not list http://127.0.0.2:")
               for p in problems), problems


def test_a_bad_description_one_line_per_problem(pdctl, tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[model]\npath = "/m"\n[proxy]\nhost = "z"\n[[hosts]]\nname = "a"\n'
                    'ip = "10.0.0.1"\ngpus = 1\nprefill = [[0]]\n')
    res = pdctl("status", "--cluster", str(path))
    assert res.exit_code == 2
    assert f"{path}: hosts: no decode instance in the cluster" in res.output
    assert f"{path}: proxy.host: z is not one of the hosts (a)" in res.output
    missing = pdctl("status", "--cluster", str(tmp_path / "none.toml"))
    assert missing.exit_code == 2 and "no such cluster description" in missing.output
    both = pdctl("status", "--cluster", str(path), "--local")
    assert both.exit_code == 2 and "give it alone" in both.output
