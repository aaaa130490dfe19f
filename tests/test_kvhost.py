"""appliance.kvhost: an interface's address as the connector's host, then the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import kvhost

P_CONFIG = {"kv_role": "kv_producer", "kv_connector_extra_config": {
    "protocol": "rdma", "host": "10.244.1.7", "bootstrap_port": 8998}}
D_CONFIG = {"kv_role": "kv_consumer", "kv_connector_extra_config": {
    "protocol": "rdma", "host": "10.244.2.9", "allowed_bootstrap_networks": ["10.244.0.0/16"]}}


def _extra(argv: list[str]) -> dict:
    raw = argv[argv.index(kvhost.KV_FLAG) + 1]
    return json.loads(raw)["kv_connector_extra_config"]


def test_ipv4_of_loopback_and_of_no_interface() -> None:
    assert kvhost.ipv4_address("lo") == "127.0.0.1"
    assert kvhost.ipv4_address("nosuch0") is None


def test_ipv6_global_addresses_only(tmp_path: Path) -> None:
    table = tmp_path / "if_inet6"
    table.write_text(
        "fe80000000000000000000fffe000001 05 40 20 80     net1\n"  # link-local
        "fd000000000000000000000000000009 05 40 00 c0     net1\n"  # tentative (DAD)
        "fd000000000000000000000000000007 05 40 00 80     net1\n"
        "fd000000000000000000000000000002 04 40 00 80     eth0\n")
    assert kvhost.ipv6_addresses("net1", table) == ["fd00::7"]
    assert kvhost.ipv6_addresses("net2", table) == []
    assert kvhost.ipv6_addresses("net1", tmp_path / "missing") == []


def test_a_missing_interface_says_what_the_pod_has() -> None:
    with pytest.raises(LookupError) as err:
        kvhost.interface_address("nosuch0", wait_s=0)
    assert "nosuch0 does not exist" in str(err.value) and "lo" in str(err.value)


def test_p_keeps_its_sidecar_on_the_pod_ip() -> None:
    argv = ["python3", "-m", "appliance.launcher", "serve", "/m", kvhost.KV_FLAG,
            json.dumps(P_CONFIG), "--port", "8010"]
    out = kvhost.with_kv_host(argv, "192.168.50.3")
    extra = _extra(out)
    assert extra["host"] == "192.168.50.3"
    assert extra["bootstrap_addr"] == "http://10.244.1.7:8998"
    assert "bootstrap_port" not in extra
    assert out[:5] == argv[:5] and out[-2:] == ["--port", "8010"]
    assert argv[6] == json.dumps(P_CONFIG)  # the caller's list is left as it was


def test_ipv6_pod_ip_in_brackets_and_the_equals_form() -> None:
    cfg = json.loads(json.dumps(P_CONFIG))
    cfg["kv_connector_extra_config"]["host"] = "fd00:10:244::5"
    (out,) = kvhost.with_kv_host([f"{kvhost.KV_FLAG}={json.dumps(cfg)}"], "fd00:99::5")
    extra = json.loads(out.split("=", 1)[1])["kv_connector_extra_config"]
    assert extra["bootstrap_addr"] == "http://[fd00:10:244::5]:8998"
    assert extra["host"] == "fd00:99::5"


def test_d_gets_the_host_alone() -> None:
    extra = _extra(kvhost.with_kv_host([kvhost.KV_FLAG, json.dumps(D_CONFIG)], "192.168.50.4"))
    assert extra == {**D_CONFIG["kv_connector_extra_config"], "host": "192.168.50.4"}


def test_a_command_without_the_config_is_refused() -> None:
    with pytest.raises(ValueError, match="no --kv-transfer-config"):
        kvhost.with_kv_host(["python3", "-m", "appliance.launcher"], "192.168.50.4")


def test_main_execs_the_command_with_the_address() -> None:
    show = "import json, sys; print(sys.argv[2])"
    done = subprocess.run(
        [sys.executable, "-m", "appliance.kvhost", "--interface", "lo", "--wait-s", "0", "--",
         sys.executable, "-c", show, kvhost.KV_FLAG, json.dumps(D_CONFIG)],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kv_connector_extra_config"]["host"] == "127.0.0.1"
    assert "KV transfer on lo (127.0.0.1)" in done.stderr


def test_main_fails_in_one_line_without_the_interface() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "appliance.kvhost", "--interface", "nosuch0", "--wait-s", "0",
         "--", "true", kvhost.KV_FLAG, "{}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("appliance.kvhost: error: interface nosuch0 does not exist")
