"""The proxy's one config file (proxy.toml): the host config's [proxy] passes through to it
(each key a ProxySettings field), pdctl derives the rest from the other sections, and the
proxy reads it alone (`--config`)."""

from __future__ import annotations

import stat

import tomllib

from appliance.pdctl.config.proxysection import MANAGED
from appliance.proxy.settings import ProxySettings, load_settings, load_toml
from tests.pdctl.conftest import GOOD_TOML
from tests.pdctl.test_cluster_render import TWO_HOSTS
from tests.pdctl.test_render import resolved


def test_proxy_settings_pass_through(pdctl, write_config):
    path = write_config(GOOD_TOML + """
[proxy]
policy = "round_robin"
max_in_flight_per_decode = 64
max_queued = 128
log_requests = false
first_token_from_prefill = false
""")
    res = pdctl("render", "--config", str(path))
    assert res.exit_code == 0, res.output
    out = path.parent
    proxy = resolved(out)["services"]["proxy"]["command"]
    assert proxy == ["python", "-m", "appliance.proxy", "--config", str(out / "proxy.toml")]
    s = load_settings(proxy[3:], environ={})
    assert (s.policy, s.max_in_flight_per_decode, s.max_queued) == ("round_robin", 64, 128)
    assert s.log_requests is False and s.first_token_from_prefill is False
    # and what pdctl derives from the other sections
    assert (s.host, s.port, s.tokenizer, s.kv_block_size) == ("0.0.0.0", 8000,
                                                              "/models/qwen", 16)
    assert s.drain_grace_s == 30 and s.split == "auto"  # the proxy's own default
    assert s.decode_prefill_chunk == 512  # D's chunk (the GPU stack's default), for auto
    # written 0600 (it holds the client keys when there are any), no client key here
    assert stat.S_IMODE((out / "proxy.toml").stat().st_mode) == 0o600
    assert "api_keys" not in load_toml(out / "proxy.toml")


def test_managed_keys_are_proxy_settings():
    assert set(MANAGED) <= set(ProxySettings.model_fields)


def test_a_cluster_proxys_settings_reach_its_host_only(pdctl, tmp_path):
    desc = tmp_path / "cluster.toml"
    desc.write_text(TWO_HOSTS.replace("itl_slo_ms = 30", "itl_slo_ms = 30\nmax_queued = 7"))
    res = pdctl("render", "--cluster", str(desc))
    assert res.exit_code == 0, res.output
    written = {h: tomllib.loads((tmp_path / "cluster" / h / "host.toml").read_text())
               for h in ("a", "b")}
    assert written["a"]["proxy"] == {"policy": "least_outstanding", "split": "never",
                                     "itl_slo_ms": 30, "max_queued": 7}
    assert "proxy" not in written["b"]

    desc.write_text(TWO_HOSTS.replace("itl_slo_ms = 30", "itl_slo_ms = 30\nport = 9000"))
    res = pdctl("render", "--cluster", str(desc))
    assert res.exit_code == 2
    assert "hosts[0] (a): proxy.port: pdctl sets it from ports.proxy" in res.stderr
