"""Cluster descriptions: the plan each implies (instances, sidecars, the proxy's backends),
and bad descriptions, one line per problem."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.pdctl.cluster.description import parse_cluster
from appliance.pdctl.errors import ConfigError
from appliance.proxy.settings import load_settings


def _desc(*hosts: dict[str, Any], **top: Any) -> dict[str, Any]:
    transfer = {} if top.get("stack") == "cpu" else {"protocol": "rdma", "device": "mlx5_0"}
    return {"model": {"path": "/models/m", **top.pop("model", {})},
            "proxy": top.pop("proxy", {"host": "a"}), "hosts": list(hosts),
            "transfer": top.pop("transfer", transfer), **top}


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_cluster(data)
    return list(err.value.lines)


def test_one_host_1p1d() -> None:
    plan = parse_cluster(_desc({"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]],
                                "decode": [[1]]})).plan()
    (p,), (d,) = plan.of("prefill"), plan.of("decode")
    assert (p.url, p.bootstrap_url, p.devices, p.engine_id) == \
        ("http://10.0.0.1:8010", "http://10.0.0.1:8998", (0,), "a-prefill-0")
    assert (d.url, d.bootstrap_url, d.devices) == ("http://10.0.0.1:8020", None, (1,))
    assert plan.proxy_url == "http://10.0.0.1:8000"
    assert plan.sidecars == ["http://10.0.0.1:8998"]


def test_2p1d_across_hosts_and_the_proxys_backends() -> None:
    plan = parse_cluster(_desc(
        {"name": "a", "ip": "10.0.0.1", "gpus": 8, "prefill": [[0], [1]]},
        {"name": "b", "ip": "10.0.0.2", "gpus": 8, "decode": [[0]]},
        proxy={"host": "b", "policy": "least_outstanding"})).plan()
    assert [p.url for p in plan.of("prefill")] == ["http://10.0.0.1:8010",
                                                    "http://10.0.0.1:8011"]
    assert plan.of("prefill", "b") == [] and len(plan.of("decode", "b")) == 1
    # each P its own sidecar (one engine per dp rank, as vLLM's bootstrap server)
    assert plan.sidecars == ["http://10.0.0.1:8998", "http://10.0.0.1:8999"]
    assert plan.proxy_url == "http://10.0.0.2:8000"
    # the proxy's own command line takes them as they are
    settings = load_settings(plan.proxy_args())
    assert [(n.url, n.bootstrap_url) for n in settings.prefill] == [
        ("http://10.0.0.1:8010", "http://10.0.0.1:8998"),
        ("http://10.0.0.1:8011", "http://10.0.0.1:8999")]
    assert [n.url for n in settings.decode] == ["http://10.0.0.2:8020"]
    assert settings.policy == "least_outstanding"


def test_1p2d_with_tp2_and_p_on_every_host() -> None:
    plan = parse_cluster(_desc(
        {"name": "a", "ip": "10.0.0.1", "gpus": 8, "prefill": [[0, 1]],
         "decode": [[2, 3], [4, 5]]},
        {"name": "b", "ip": "fd00::2", "gpus": 2, "prefill": [[0, 1]]},
        model={"tp_size": 2})).plan()
    assert [d.url for d in plan.of("decode")] == ["http://10.0.0.1:8020",
                                                   "http://10.0.0.1:8021"]
    assert plan.sidecars == ["http://10.0.0.1:8998", "http://[fd00::2]:8998"]


def test_cpu_stack_counts_cpus_and_no_tp() -> None:
    plan = parse_cluster(_desc({"name": "a", "ip": "127.0.0.1", "cpus": 4,
                                "prefill": [[0, 1]], "decode": [[2, 3]]}, stack="cpu")).plan()
    assert plan.of("decode")[0].devices == (2, 3)


def test_bad_descriptions_one_line_each() -> None:
    lines = _problems(_desc(
        {"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0], [1]], "decode": [[1]]},
        {"name": "a", "ip": "10.0.0.1", "gpus": 1, "prefill": [[3]]},
        proxy={"host": "c"}))
    assert lines == [
        "hosts[0].decode[0]: GPU 1 is also prefill[1] (over-committed)",
        "hosts[1].name: a is also hosts[0]",
        "hosts[1].ip: 10.0.0.1 is also hosts[0]",
        "hosts[1].prefill[0]: GPU 3 is past the host's 1 (a has GPUs 0-0)",
        "proxy.host: c is not one of the hosts (a, a)",
    ]


@pytest.mark.parametrize("hosts, wanted", [
    ([{"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]]}],
     "hosts: no decode instance in the cluster (a cluster needs P and D)"),
    ([{"name": "a", "ip": "10.0.0.1", "gpus": 2, "decode": [[0]]}],
     "hosts: no prefill instance in the cluster (a cluster needs P and D)"),
    ([{"name": "a", "ip": "10.0.0.1", "gpus": 4, "prefill": [[0, 1]], "decode": [[2]]}],
     "hosts[0].prefill[0]: 2 GPUs for a prefill TP size of 1"),
    ([{"name": "a", "ip": "10.0.0.1", "prefill": [[0]], "decode": [[1]]}],
     "hosts[0].prefill[0]: a has no GPUs (set hosts[0].gpus)"),
    ([{"name": "a", "ip": "10.0.0.1", "gpus": 12, "prefill": [[g] for g in range(11)],
       "decode": [[11]]}],
     "hosts[0].decode[0]: port 8020 is also prefill[10]'s (instance i listens on "
     "ports.decode + i: set the ports further apart)"),
    ([{"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[]], "decode": [[1]]}],
     "hosts.0.prefill: each instance needs at least one GPU (or CPU)"),
    ([{"name": "a", "ip": "0.0.0.0", "gpus": 2, "prefill": [[0]], "decode": [[1]]}],
     "hosts.0.ip: must be the address peers reach this host at, not 0.0.0.0"),
])
def test_each_problem(hosts: list[dict[str, Any]], wanted: str) -> None:
    assert wanted in _problems(_desc(*hosts))


def test_the_example_description_is_valid() -> None:
    from appliance.pdctl.cluster.description import load_cluster
    from tests.conftest import ROOT

    plan = load_cluster(ROOT / "config" / "cluster.example.toml").plan()
    assert (len(plan.of("prefill")), len(plan.of("decode"))) == (2, 3)
