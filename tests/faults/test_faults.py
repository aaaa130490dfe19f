"""Fault injection (tests.faults): the plan is parsed from the environment, off by default,
its draws seeded; the connector real servers load applies it through the product's seams
and is the product's connector without one."""

from __future__ import annotations

import ctypes
import time
from types import SimpleNamespace

import pytest

from appliance.connector.planning.descriptors import Descriptors
from appliance.connector.settings import ConnectorSettings
from appliance.connector.transfers.mooncake import MooncakeTransport
from appliance.connector.transfers.transport import TransferError
from tests.connector.fake_transport import FakeNetwork, FakeTransport
from tests.faults import plan as faults
from tests.faults.connector import PDConnector, dropping
from tests.faults.launch import MODULE, faulty_config
from tests.faults.transport import FaultyTransport


def test_off_unless_the_environment_asks():
    assert faults.from_env({}) is None
    f = faults.from_env({faults.ENV: "write_fail=16,reply_drop=4,write_delay_ms=2.5,seed=7"})
    assert f is not None and f.plan == faults.FaultPlan(write_fail=16, reply_drop=4,
                                                        write_delay_ms=2.5, seed=7)


def test_a_hold_file_holds_new_prefills_while_it_exists(tmp_path):
    hold = tmp_path / "hold"
    f = faults.from_env({faults.ENV: f"prefill_hold_file={hold}"})
    assert f is not None and not f.holding_prefills()
    hold.touch()
    assert f.holding_prefills()
    assert faults.Faults(faults.FaultPlan()).holding_prefills() is False


@pytest.mark.parametrize("text, words", [
    ("write_fail", "is not one of"), ("explode=1", "is not one of"),
    ("write_fail=x", "needs a number"), ("reply_drop=-1", "must not be negative")])
def test_bad_plans_are_one_line_errors(text, words):
    with pytest.raises(ValueError, match=words):
        faults.FaultPlan.parse(text)


def test_one_in_n_is_seeded_and_counted():
    def draws(seed: int) -> list[bool]:
        f = faults.Faults(faults.FaultPlan(reply_drop=4, seed=seed))
        return [f.drop_reply() for _ in range(400)]

    assert draws(1) == draws(1) != draws(2)
    hits = sum(draws(1))
    assert 60 < hits < 140  # about 1 in 4


def _two_ends():
    """64 bytes of P's memory and of D's, each side's in-memory transport, D's session."""
    network = FakeNetwork()
    src, dst = (ctypes.create_string_buffer(b"kv" * 32), ctypes.create_string_buffer(64))
    p, d = FakeTransport(network), FakeTransport(network)
    d_session = d.start("127.0.0.1")
    p.start("127.0.0.1")
    return src, dst, p, d, d_session


def test_faulty_writes_fail_one_in_n_and_otherwise_land():
    """Over the in-memory transport: each write that is not failed copies its bytes."""
    src, dst, p, d, d_session = _two_ends()
    p.register([(ctypes.addressof(src), 64)])
    d.register([(ctypes.addressof(dst), 64)])
    f = faults.Faults(faults.FaultPlan(write_fail=3, seed=0))
    faulty = FaultyTransport(p, f)
    landed = 0
    for i in range(60):
        ctypes.memset(dst, 0, 64)
        descs = Descriptors([ctypes.addressof(src) + i % 32], [ctypes.addressof(dst)], [1])
        try:
            assert faulty.write(d_session, descs).nbytes == 1
            landed += 1
            assert dst.raw[0] == src.raw[i % 32]
        except TransferError as exc:
            assert "injected" in str(exc) and dst.raw[0] == 0
    assert f.injected["write_fail"] == 60 - landed > 5
    assert (faulty.session_id, faulty.rpc_port) == (p.session_id, p.rpc_port)


def test_faulty_writes_start_late():
    network = FakeNetwork()
    p, d = FakeTransport(network), FakeTransport(network)
    p.start("127.0.0.1")
    faulty = FaultyTransport(p, faults.Faults(faults.FaultPlan(write_delay_ms=50)))
    start = time.monotonic()
    faulty.write(d.start("127.0.0.1"), Descriptors())
    assert time.monotonic() - start >= 0.05


def test_dropped_replies_never_reach_the_receiver():
    got: list[tuple] = []
    every = dropping(faults.Faults(faults.FaultPlan(reply_drop=1)), lambda *a: got.append(a))
    every("peer", "resp")
    assert got == []
    none = dropping(faults.Faults(faults.FaultPlan()), lambda *a: got.append(a))
    none("peer", "resp")
    assert got == [("peer", "resp")]


def _bare(role: str, plan: str | None) -> PDConnector:
    c = PDConnector.__new__(PDConnector)
    c.settings = ConnectorSettings(engine_id="e", role=role, bootstrap_addr="http://127.0.0.1:1")
    c.faults = faults.from_env({faults.ENV: plan} if plan else {})
    return c


def test_the_connector_wraps_the_producers_transport_only_with_a_plan():
    assert type(_bare("producer", None).new_transport()) is MooncakeTransport
    assert type(_bare("consumer", "write_fail=2").new_transport()) is MooncakeTransport
    wrapped = _bare("producer", "write_fail=2").new_transport()
    assert isinstance(wrapped, FaultyTransport)
    assert type(wrapped.inner) is MooncakeTransport


def test_the_connector_holds_split_prefills_while_the_file_exists(tmp_path, monkeypatch):
    """A backed-up P: vLLM skips a request whose matched tokens are not known yet (None) and
    asks again next step; an abort meanwhile removes it uncomputed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    hold = tmp_path / "hold"
    monkeypatch.setenv(faults.ENV, f"prefill_hold_file={hold}")
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role="kv_producer", engine_id="p0", kv_connector_extra_config={}))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=type("FullAttentionSpec", (), {"block_size": 16})(),
        layer_names=["model.layers.0.attn"], enable_kv_transfer=True)])
    c = PDConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    def req(rid: str, params: dict) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(40)),
                               kv_transfer_params=params, num_computed_tokens=0,
                               block_hashes=[], num_prompt_tokens=40)

    split = req("p1", {"do_remote_decode": True, "transfer_id": "x1"})
    assert c.get_num_new_matched_tokens(split, 0) == (0, False)
    hold.touch()
    assert c.get_num_new_matched_tokens(split, 0) == (None, False)
    assert c.get_num_new_matched_tokens(req("p2", {}), 0) == (0, False)  # only split ones
    hold.unlink()
    assert c.get_num_new_matched_tokens(split, 0) == (0, False)


def test_servers_load_it_by_module_path_under_the_products_name():
    config = faulty_config('{"kv_connector": "PDConnector", "kv_role": "kv_producer", '
                           '"kv_connector_module_path": "appliance.connector"}')
    assert MODULE in config and '"kv_connector": "PDConnector"' in config
    assert PDConnector.__name__ == "PDConnector"


def test_corrupted_writes_report_success_with_junk_in_the_first_block():
    src, dst, p, d, d_session = _two_ends()
    f = faults.Faults(faults.FaultPlan(write_corrupt=2, seed=1))
    faulty = FaultyTransport(p, f)
    faulty.register([(ctypes.addressof(src), 64)])  # and, through it, the junk
    d.register([(ctypes.addressof(dst), 64)])
    corrupted = 0
    for _ in range(20):
        ctypes.memset(dst, 0, 64)
        faulty.write(d_session, Descriptors([ctypes.addressof(src)], [ctypes.addressof(dst)],
                                            [64]))
        if dst.raw[:8] == b"\xa5" * 8:
            corrupted += 1
            assert dst.raw[8:] == src.raw[8:64]
        else:
            assert dst.raw == src.raw[:64]
    assert f.injected["write_corrupt"] == corrupted > 3
