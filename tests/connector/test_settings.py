"""The connector's settings as vLLM hands them over (`--kv-transfer-config`): good ones are
typed, bad ones fail vLLM's start with one line naming every problem."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance.connector.settings import ConnectorSettings


def config(role: str = "kv_producer", engine_id: str = "p0", **extra):
    return SimpleNamespace(kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra)


def test_defaults_and_roles() -> None:
    s = ConnectorSettings.from_kv_transfer_config(config())
    assert s.is_producer and s.early_push and s.cpu_push_delay_ms == 20 and s.protocol == "tcp"
    d = ConnectorSettings.from_kv_transfer_config(
        config("kv_consumer", "d0", protocol="rdma", device_name="mlx5_0", recv_timeout_s=5))
    assert not d.is_producer and (d.protocol, d.device_name, d.recv_timeout_s) == (
        "rdma", "mlx5_0", 5)


def test_side_channel_security_settings() -> None:
    s = ConnectorSettings.from_kv_transfer_config(config())
    assert (s.side_channel_key_file, s.max_message_bytes, s.max_message_entries,
            s.internal_networks) == (None, 16 << 20, 512, None)  # off, bounded, D's own host
    s = ConnectorSettings.from_kv_transfer_config(config(
        side_channel_key_file="/run/secrets/pd.key", max_message_entries=8,
        internal_networks=["10.1.2.3/8", "fd00::/8"]))
    assert s.side_channel_key_file == "/run/secrets/pd.key" and s.max_message_entries == 8
    assert s.internal_networks == ("10.0.0.0/8", "fd00::/8")  # normalized, host bits dropped


def test_token_file_is_read(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = ConnectorSettings.from_kv_transfer_config(config(bootstrap_token_file=str(token)))
    assert s.bootstrap_token == "s3cret"


@pytest.mark.parametrize(("cfg", "words"), [
    (config("kv_both"), ["kv_producer or kv_consumer", "kv_both"]),
    (config(engine_id=""), ["engine_id"]),
    (config(protocol="udp"), ["protocol"]),
    (config(cpu_push_delay_ms=-1), ["cpu_push_delay_ms"]),
    (config(early_psuh=False), ["early_psuh"]),  # a typo is an error, not ignored
    (config(recv_timeout_s=0, num_workers=0), ["recv_timeout_s", "num_workers"]),
    (config(internal_networks=["10.0.0.0/33"]), ["internal_networks", "not a CIDR"]),
    (config(internal_networks=["d-host"]), ["internal_networks", "d-host"]),
    (config(max_message_bytes=0, max_message_entries=0),
     ["max_message_bytes", "max_message_entries"]),
])
def test_bad_settings_fail_with_one_line_naming_them(cfg, words) -> None:
    with pytest.raises(ValueError) as err:
        ConnectorSettings.from_kv_transfer_config(cfg)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_bootstrap_allowed_by_address_or_network() -> None:
    open_node = ConnectorSettings.from_kv_transfer_config(config("kv_consumer", "d0"))
    assert not open_node.guards_bootstrap and open_node.bootstrap_allowed("http://anywhere:1")
    pods = ConnectorSettings.from_kv_transfer_config(config(
        "kv_consumer", "d0", allowed_bootstrap_networks=["10.244.1.7/16", "fd00:10::/64"]))
    assert pods.guards_bootstrap and pods.allowed_bootstrap_networks == (
        "10.244.0.0/16", "fd00:10::/64")
    assert pods.bootstrap_allowed("http://10.244.3.9:8998")  # a P pod, restarted anywhere
    assert pods.bootstrap_allowed("http://[fd00:10::5]:8998/")
    assert not pods.bootstrap_allowed("http://10.245.0.1:8998")  # outside the network
    assert not pods.bootstrap_allowed("http://p-0.pd.svc:8998")  # a hostname never matches
    assert not pods.bootstrap_allowed("tcp://10.244.3.9:8998")
    assert not pods.bootstrap_allowed("http://[fd00:10::5")  # not a URL
    both = ConnectorSettings.from_kv_transfer_config(config(
        "kv_consumer", "d0", allowed_bootstrap_addrs=["http://p-0.pd.svc:8998"],
        allowed_bootstrap_networks=["10.244.0.0/16"]))
    assert both.bootstrap_allowed("http://p-0.pd.svc:8998/")  # listed
    assert both.bootstrap_allowed("http://10.244.0.3:8998")  # in the network
    assert not both.bootstrap_allowed("http://p-1.pd.svc:8998")
    addrs_only = ConnectorSettings.from_kv_transfer_config(config(
        "kv_consumer", "d0", allowed_bootstrap_addrs=["http://10.0.0.1:8998"]))
    assert not addrs_only.bootstrap_allowed("http://10.0.0.2:8998")  # as before
    with pytest.raises(ValueError, match="allowed_bootstrap_networks.*not a CIDR"):
        ConnectorSettings.from_kv_transfer_config(config(
            "kv_consumer", "d0", allowed_bootstrap_networks=["pods"]))


@pytest.mark.parametrize(("host", "url"), [
    ("10.244.3.9", "http://10.244.3.9:8998"),
    ("fd00:10::5", "http://[fd00:10::5]:8998"),  # an IPv6 pod IP goes in brackets
])
def test_bootstrap_port_at_the_host(host: str, url: str) -> None:
    """The chart gives P the sidecar's port and its pod IP as `host`: the URL is built
    here, so an IPv6 pod network works, and D's network check accepts it."""
    p = ConnectorSettings.from_kv_transfer_config(config(host=host, bootstrap_port=8998))
    assert p.bootstrap_addr == url
    d = ConnectorSettings.from_kv_transfer_config(config(
        "kv_consumer", "d0", allowed_bootstrap_networks=["10.244.0.0/16", "fd00:10::/64"]))
    assert d.bootstrap_allowed(p.bootstrap_addr)


def test_bootstrap_port_falls_back_to_vllm_host_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_HOST_IP", "fd00::7")
    s = ConnectorSettings.from_kv_transfer_config(config(bootstrap_port=9000))
    assert s.bootstrap_addr == "http://[fd00::7]:9000"


def test_bootstrap_port_or_addr_not_both() -> None:
    with pytest.raises(ValueError, match="bootstrap_addr or bootstrap_port, not both"):
        ConnectorSettings.from_kv_transfer_config(config(
            host="10.0.0.1", bootstrap_port=8998, bootstrap_addr="http://10.0.0.1:8998"))
    with pytest.raises(ValueError, match="bootstrap_port"):
        ConnectorSettings.from_kv_transfer_config(config(bootstrap_port=0))


async def test_a_worker_registers_with_a_sidecar_on_ipv6() -> None:
    """The URL built from an IPv6 host reaches a real sidecar listening there."""
    from aiohttp import web

    from appliance.bootstrap import BootstrapSettings, build_app
    from appliance.bootstrap.client import BootstrapClient
    from appliance.bootstrap.wire import Registration

    runner = web.AppRunner(build_app(BootstrapSettings(host="::1", port=0, ttl=0)))
    await runner.setup()
    site = web.TCPSite(runner, "::1", 0)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        pytest.skip(f"no IPv6 loopback here: {exc}")
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s = ConnectorSettings.from_kv_transfer_config(config(host="::1", bootstrap_port=port))
    client = BootstrapClient(s.bootstrap_addr)
    try:
        await client.register(Registration(engine_id="p0", addr="tcp://[::1]:41235"))
        assert (await client.query())["0"].engine_id == "p0"
    finally:
        await client.close()
        await runner.cleanup()
