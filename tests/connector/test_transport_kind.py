"""Which transport Mooncake installs, and who hears about it.

Mooncake installs RDMA whenever its own discovery finds a usable RDMA device, whatever
``protocol`` says, and TCP when it finds none: so ``tcp`` must set ``MC_FORCE_TCP`` before the
engine exists, an ``rdma`` that ends on TCP must stop start-up, and P and D report the
installed transport (``vllm:pd_kv_transport_info``, read by ``pdctl status``).

Real Mooncake (the non-CUDA build, no RDMA device here) shows the TCP side; what an RDMA host's
discovery would answer comes from ``FakeEngine``, through ``MooncakeTransport``'s one seam, the
engine factory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.connector.stats import (
    PDConnectorStats,
    TransferStats,
    build_prom_metrics,
)
from appliance.connector.transfers.mooncake import (
    MooncakeTransport,
    TransferError,
    installed_transport,
    topology_hcas,
)
from appliance.pdctl.node.status import metric_samples, transport

NO_HCA = json.dumps({"cpu:0": [[], []]})
ONE_HCA = json.dumps({"cpu:0": [["mlx5_0"], []], "cuda:0": [["mlx5_0"], []]})


class FakeEngine:
    """Mooncake's TransferEngine as far as start-up goes; ``topology`` is what its discovery
    would find on the host (``get_local_topology``)."""

    def __init__(self, topology: str = NO_HCA) -> None:
        self.topology = topology
        self.initialized = False
        self.init_device = ""
        self.env_at_init: str | None = None
        self.topology_asked: list[str] = []

    def initialize(self, host: str, metadata: str, protocol: str, device_name: str) -> int:
        self.initialized, self.init_device = True, device_name
        self.env_at_init = os.environ.get("MC_FORCE_TCP")
        return 0

    def get_local_topology(self, device_name: str = "") -> str:
        self.topology_asked.append(device_name)
        return self.topology

    def get_rpc_port(self) -> int:
        return 15001


@pytest.fixture
def sys_root(tmp_path) -> str:
    """A /sys naming mlx5_0, so the pre-start device check passes."""
    (tmp_path / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    return str(tmp_path)


def started(engine: FakeEngine, protocol: str, sys_root: str,
            device: str = "mlx5_0") -> MooncakeTransport:
    t = MooncakeTransport(lambda: engine)
    t.start("127.0.0.1", protocol, device, sys_root=sys_root)
    return t


# --- tcp ---------------------------------------------------------------------------------


def test_tcp_forces_tcp_in_real_mooncake_before_it_starts() -> None:
    pytest.importorskip("mooncake.engine")
    from mooncake.engine import TransferEngine

    engines: list[Any] = []
    seen: list[str | None] = []

    def engine() -> Any:
        seen.append(os.environ.get("MC_FORCE_TCP"))
        engines.append(TransferEngine())
        return engines[-1]

    t = MooncakeTransport(engine)
    try:
        t.start("127.0.0.1", "tcp")
        assert seen == ["1"] and t.transport == "tcp"
        # Mooncake reads it: forced, its init returns before discovery (no topology at all,
        # where unforced it lists this host's NUMA nodes).
        assert json.loads(engines[0].get_local_topology("")) == {}
    finally:
        t.close()


def test_tcp_keeps_a_value_the_user_set(monkeypatch, sys_root) -> None:
    monkeypatch.setenv("MC_FORCE_TCP", "true")  # any value already forces TCP
    engine = FakeEngine(ONE_HCA)
    t = started(engine, "tcp", sys_root, device="")
    assert os.environ["MC_FORCE_TCP"] == "true" and engine.env_at_init == "true"
    assert t.transport == "tcp" and engine.topology_asked == []  # nothing to probe


# --- rdma --------------------------------------------------------------------------------


def test_rdma_that_ends_on_tcp_stops_start_up(sys_root) -> None:
    # mlx5_0 is in /sys, but Mooncake's discovery found it unusable (no /dev node, port down).
    engine = FakeEngine(NO_HCA)
    t = MooncakeTransport(lambda: engine)
    with pytest.raises(TransferError) as err:
        t.start("127.0.0.1", "rdma", "mlx5_0", sys_root=sys_root)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("protocol rdma asked, but Mooncake installed tcp: it found no usable "
                          "RDMA device among 'mlx5_0'")
    assert 'use protocol "tcp"' in msg
    assert engine.initialized and engine.topology_asked == ["mlx5_0"]  # after init, same filter
    assert not t.started and t.transport == ""


def test_rdma_with_a_usable_device_reports_rdma(sys_root) -> None:
    engine = FakeEngine(ONE_HCA)
    t = started(engine, "rdma", sys_root)
    assert t.transport == "rdma" and t.started
    assert "MC_FORCE_TCP" not in os.environ and engine.env_at_init is None


def test_rdma_device_list_reaches_mooncake_without_spaces_and_skips_are_named(
        sys_root, caplog) -> None:
    (Path(sys_root) / "class" / "infiniband" / "mlx5_1").mkdir()
    engine = FakeEngine(ONE_HCA)  # mlx5_1 is in /sys, but Mooncake found it unusable
    with caplog.at_level(logging.WARNING, "vllm.appliance.connector.mooncake"):
        t = started(engine, "rdma", sys_root, device="mlx5_0, mlx5_1")
    assert engine.init_device == "mlx5_0,mlx5_1" and engine.topology_asked == ["mlx5_0,mlx5_1"]
    assert t.transport == "rdma"
    assert "Mooncake skipped mlx5_1" in caplog.text and "over mlx5_0 only" in caplog.text


def test_rdma_refuses_a_true_mc_force_tcp(monkeypatch, sys_root) -> None:
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    t = MooncakeTransport(lambda: pytest.fail("Mooncake started"))  # refused before it
    with pytest.raises(TransferError, match=r"protocol rdma, but MC_FORCE_TCP='1' is set.*"
                                            r"unset MC_FORCE_TCP, or use protocol \"tcp\""):
        t.start("127.0.0.1", "rdma", "mlx5_0", sys_root=sys_root)


def test_rdma_drops_a_false_mc_force_tcp(monkeypatch, sys_root) -> None:
    monkeypatch.setenv("MC_FORCE_TCP", "0")  # Mooncake would still force TCP: getenv only
    engine = FakeEngine(ONE_HCA)
    t = started(engine, "rdma", sys_root)
    assert engine.env_at_init is None and t.transport == "rdma"


def test_installed_transport_follows_mooncakes_order() -> None:
    hca = ["mlx5_0"]
    assert installed_transport({}, hca) == "rdma"
    assert installed_transport({}, []) == "tcp"
    assert installed_transport({"MC_FORCE_TCP": "0"}, hca) == "tcp"  # presence, not value
    assert installed_transport({"MC_FORCE_HCA": "1"}, []) == "rdma"
    assert installed_transport({"MC_INTRANODE_NVLINK": "1"}, hca) == "rdma"  # not built in
    assert installed_transport({"MC_INTRANODE_NVLINK": "1"}, hca,
                               intra_nvlink=True) == "nvlink_intra"
    assert installed_transport({}, [], mnnvl=True) == "nvlink"
    assert installed_transport({"MC_FORCE_MNNVL": "1"}, hca, mnnvl=True) == "nvlink"
    assert installed_transport({}, hca, mnnvl=True) == "rdma"


def test_topology_hcas_reads_mooncakes_matrix() -> None:
    assert topology_hcas(ONE_HCA) == ["mlx5_0"]
    two = {"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:1": [["mlx5_1"], ["mlx5_0"]]}
    assert topology_hcas(json.dumps(two)) == ["mlx5_0", "mlx5_1"]
    assert topology_hcas("{}") == topology_hcas("") == topology_hcas("not json") == []


# --- reporting ---------------------------------------------------------------------------


def test_each_worker_reports_its_transport_once() -> None:
    stats = TransferStats()
    stats.record_transport("rdma")
    first = stats.snapshot()
    assert first is not None and first.data["transport_rdma"] == 1
    assert stats.snapshot() is None  # once, not every step
    other = PDConnectorStats(data={"transport_rdma": 1})
    assert first.aggregate(other).data["transport_rdma"] == 2  # TP workers add up


def prom_metrics(protocol: str) -> tuple[Any, Any]:
    """build_prom_metrics on a private registry, as vLLM's API server builds it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    kv = SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config={"protocol": protocol})
    metrics = build_prom_metrics(SimpleNamespace(kv_transfer_config=kv), types,
                                 ["model_name", "engine"], {0: ["tiny", "0"]})
    return metrics, reg


def shown(reg: Any) -> str | None:
    """What `pdctl status` reads from this /metrics text."""
    from prometheus_client import generate_latest

    return transport(metric_samples(generate_latest(reg).decode()))


def test_metrics_carry_the_transport_and_status_reads_it() -> None:
    from prometheus_client import generate_latest

    metrics, reg = prom_metrics("rdma")
    assert shown(reg) == "rdma"  # before any step: the protocol start-up guaranteed
    text = generate_latest(reg).decode()
    assert ('vllm:pd_kv_transport_info{engine="0",model_name="tiny",role="producer",'
            'transport="rdma"} 1.0') in text
    metrics.observe({"transport_tcp": 1}, 0)  # the workers' own report wins
    assert shown(reg) == "tcp"
