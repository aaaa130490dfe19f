"""The node's keys (pdctl init, --rotate-keys, render), what doctor warns about, and the
decode node's HTTP guard of kv_transfer_params."""

from __future__ import annotations

import json

from appliance import keys
from appliance.connector.httpguard import bootstrap_problem
from appliance.connector.settings import ConnectorSettings
from tests.pdctl.conftest import GOOD_TOML


def _secrets(d) -> dict[str, str]:
    return {n: (d / n).read_text() for n in keys.NAMES}


def test_init_writes_the_keys_and_rotate_replaces_only_them(pdctl, tmp_path):
    out = tmp_path / "etc" / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--name", "node1")
    assert res.exit_code == 0, res.output
    kdir = out.parent / "keys"
    assert kdir.stat().st_mode & 0o777 == 0o700
    for name in keys.NAMES:
        assert (kdir / name).stat().st_mode & 0o777 == 0o600
    first, config = _secrets(kdir), out.read_text()
    assert len(set(first.values())) == 3 and all(v.strip() for v in first.values())
    # a second init (--force) keeps the keys: the running node's peers hold them
    assert pdctl("init", "--out", str(out), "--model", "/models/qwen", "--name", "node1",
                 "--force").exit_code == 0
    assert _secrets(kdir) == first
    res = pdctl("init", "--out", str(out), "--rotate-keys")
    assert res.exit_code == 0, res.output
    rotated = _secrets(kdir)
    assert all(rotated[n] != first[n] for n in keys.NAMES)
    assert out.read_text() == config
    bad = pdctl("init", "--out", str(tmp_path / "none.toml"), "--rotate-keys")
    assert bad.exit_code == 2 and "no config at" in bad.output


def test_curve_key_is_a_z85_secret(tmp_path):
    from appliance.sidechannel.curve import read_key

    k = keys.ensure(tmp_path / "k")
    key = read_key(k.side_channel_key)
    assert len(key.public) == 40 and len(key.secret) == 40


def test_doctor_warns_about_a_public_internal_address_and_mooncake_ports(pdctl,
                                                                           write_config):
    res = pdctl("doctor", "--config", str(write_config(GOOD_TOML)), "--json")
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["internal address"]["status"] == "pass"
    assert checks["mooncake ports"]["status"] == "warn"
    assert "17000-17199" in checks["mooncake ports"]["fix"]
    assert checks["proxy bind"]["status"] == "warn"
    public = GOOD_TOML.replace('ip = "10.0.0.11"', 'ip = "8.8.4.4"')
    res = pdctl("doctor", "--config", str(write_config(public)), "--json")
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["internal address"]["status"] == "warn"
    assert "public" in checks["internal address"]["detail"]
    assert res.exit_code == 0 or any(c["status"] == "fail" for c in checks.values()
                                     if c["name"] != "internal address")


def test_guard_refuses_only_pulls_through_a_foreign_bootstrap():
    s = ConnectorSettings(engine_id="d", role="consumer",
                          allowed_bootstrap_addrs=("http://10.0.0.11:8998",))
    pull = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://10.0.0.11:8998/"}
    assert bootstrap_problem(s, {"kv_transfer_params": pull}) is None
    foreign = {**pull, "remote_bootstrap_addr": "http://attacker:8998"}
    assert "not a bootstrap address" in bootstrap_problem(s, {"kv_transfer_params": foreign})
    assert bootstrap_problem(s, {"kv_transfer_params": {**foreign, "remote_bootstrap_addr": 5}})
    assert bootstrap_problem(s, {"kv_transfer_params": {**foreign,
                                                        "do_remote_prefill": False}}) is None
    assert bootstrap_problem(s, {"prompt": "no params"}) is None
    open_node = ConnectorSettings(engine_id="d", role="consumer")
    assert bootstrap_problem(open_node, {"kv_transfer_params": foreign}) is None


def test_launcher_refuses_a_missing_or_empty_api_key_file(tmp_path):
    import os
    import subprocess
    import sys

    empty = tmp_path / "api-key"
    empty.write_text("\n")
    for path, words in ((tmp_path / "none", "No such file"), (empty, "is empty")):
        res = subprocess.run([sys.executable, "-m", "appliance.launcher", "serve", "m"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, keys.API_KEY_FILE_ENV: str(path)})
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1
        assert lines[0].startswith(f"launcher: error: {keys.API_KEY_FILE_ENV} {path}")
        assert words in lines[0]
