"""Host config validation: every bad value gives its own one-line message and exit code 2."""

from __future__ import annotations

import re

import pytest

from appliance.pdctl.config.hostconfig import HostConfig, load_config, parse_config
from appliance.pdctl.config.toml import to_toml
from tests.conftest import ROOT
from tests.pdctl.conftest import GOOD_TOML, error_lines


def edit(toml: str, section: str, key: str, value: str) -> str:
    """Set `key = value` in [section] (replacing the key or adding it)."""
    lines = toml.splitlines()
    start = lines.index(f"[{section}]") if f"[{section}]" in lines else None
    if start is None:
        return toml + f"\n[{section}]\n{key} = {value}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")),
               len(lines))
    for i in range(start + 1, end):
        if re.match(rf"^{re.escape(key)}\s*=", lines[i]):
            lines[i] = f"{key} = {value}"
            return "\n".join(lines) + "\n"
    lines.insert(end, f"{key} = {value}")
    return "\n".join(lines) + "\n"


def test_good_config_passes(pdctl, write_config):
    path = write_config(GOOD_TOML)
    res = pdctl("validate", "--config", str(path))
    assert res.exit_code == 0, res.output
    assert f"{path}: ok" in res.stdout


def test_example_config_parses():
    cfg = load_config(ROOT / "config" / "host.example.toml")
    assert cfg.transfer.protocol == "rdma" and cfg.transfer.gpudirect == "auto"
    assert (cfg.transfer.devices("prefill"), cfg.transfer.devices("decode")) == \
        (["mlx5_0"], ["mlx5_1"])
    assert (cfg.gpus.prefill, cfg.gpus.decode) == ([0], [1])
    assert cfg.ports.model_dump() == {"proxy": 8000, "prefill": 8010, "decode": 8020,
                                      "bootstrap": 8998}
    assert cfg.stack == "gpu"


def test_cpu_example_config_parses():
    cfg = load_config(ROOT / "config" / "host.cpu.example.toml")
    assert (cfg.stack, cfg.transfer.protocol, cfg.block_size) == ("cpu", "tcp", 32)
    assert (cfg.cpus.prefill, cfg.cpus.decode) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert cfg.vllm_image == "pd-appliance/vllm-cpu:0.1.0"


BAD = [
    # (section, key, value, message)
    ("ports", "decode", "8010", "ports.decode: 8010 is also ports.prefill"),
    ("ports", "bootstrap", "8000", "ports.bootstrap: 8000 is also ports.proxy"),
    ("ports", "proxy", "70000", "ports.proxy: Input should be less than or equal to 65535"),
    ("ports", "proxy", '"http"', "ports.proxy: Input should be a valid integer"),
    ("gpus", "decode", "[5]", "gpus.decode: GPU 5 does not exist on this host (GPUs: 0, 1)"),
    ("gpus", "prefill", "[3]", "gpus.prefill: GPU 3 does not exist on this host"),
    ("gpus", "prefill", "[2, 3]", "gpus.prefill: 2 GPUs for a prefill TP size of 1"),
    ("gpus", "decode", "[0]", "gpus.decode: GPU 0 is also in gpus.prefill"),
    ("gpus", "prefill", "[-1]", "gpus.prefill.0: Input should be greater than or equal to 0"),
    ("gpus", "prefill", "[0, 0]", "gpus.prefill: GPU 0 is listed twice"),
    ("gpus", "prefill", "[]", "gpus.prefill: List should have at least 1 item"),
    ("model", "tp_size", "2", "gpus.prefill: 1 GPU for a prefill TP size of 2"),
    ("model", "decode_tp_size", "2", "gpus.decode: 1 GPU for a decode TP size of 2"),
    ("transfer", "device", '"mlx5_9"',
     "transfer.device: unknown RDMA device 'mlx5_9' (this host has: mlx5_0)"),
    ("transfer", "device", '""', "transfer.device: required when transfer.protocol is rdma"),
    ("transfer", "device", '"mlx5 0"', "transfer.device: 'mlx5 0' is not an RDMA device name"),
    ("transfer", "device", '"mlx5_0,mlx5_0"', "transfer.device: mlx5_0 is listed twice"),
    ("transfer", "prefill_devices", '["mlx5_0", "x y"]',
     "transfer.prefill_devices: 'x y' is not an RDMA device name"),
    ("transfer", "protocol", '"ib"', "transfer.protocol: Input should be 'rdma' or 'tcp'"),
    ("transfer", "gpudirect", '"magic"',
     "transfer.gpudirect: Input should be 'auto', 'peermem' or"),
    ("host", "ip", '"10.0.0.300"', "host.ip: '10.0.0.300' is not an IP address"),
    ("host", "ip", '"0.0.0.0"', "host.ip: must be the address peers reach this host at"),
    ("host", "name", '"bad name"', "host.name: must be letters, digits"),
    ("model", "path", '"models/qwen"', "model.path: the model directory must be an absolute"),
    ("model", "path", '"/models/missing"', "model.path: /models/missing does not exist on this"),
    ("model", "path", '"/models/my model"', "model.path: the model directory must not contain"),
    ("model", "block_size", "24", "model.block_size: Input should be 16, 32, 64 or 128"),
    ("model", "extra_args", '["--port", "9000"]',
     "model.extra_args: --port is set by pdctl (use ports.prefill / ports.decode)"),
    ("model", "decode_extra_args", '["--kv-transfer-config={}"]',
     "model.decode_extra_args: --kv-transfer-config is set by pdctl"),
    ("model", "gpu_memory_utilization", "1.5", "model.gpu_memory_utilization: Input should be"),
    ("model", "decode_prefill_chunk", "-1", "model.decode_prefill_chunk: Input should be"),
    ("model", "decode_extra_args", '["--long-prefill-token-threshold=64"]',
     "model.decode_extra_args: --long-prefill-token-threshold is set by pdctl (use "
     "model.decode_prefill_chunk)"),
    ("model", "max_num_batched_tokens", "-1", "model.max_num_batched_tokens: Input should be"),
    ("model", "extra_args", '["--max-num-batched-tokens", "512"]',
     "model.extra_args: --max-num-batched-tokens is set by pdctl (use "
     "model.max_num_batched_tokens)"),
    ("ports", "metrics", "9000", "ports.metrics: unknown key"),
    ("timeouts", "startup_s", "0", "timeouts.startup_s: Input should be greater than 0"),
    ("tracing", "otlp_endpoint", '"collector:4317"',
     "tracing.otlp_endpoint: 'collector:4317' is not an http:// or https:// URL"),
    ("tracing", "protocol", '"thrift"', "tracing.protocol: Input should be 'grpc' or"),
    ("timeouts", "kv_transfer_s", "2",
     "timeouts.kv_transfer_s: Input should be greater than or equal to 5"),
    ("compose", "project", '"PD App"', "compose.project: must be lowercase letters"),
    ("compose", "shm_size", '"lots"', "compose.shm_size: 'lots' is not a size"),
    ("images", "vllm", '"Not An Image"', "images.vllm: 'Not An Image' is not an image reference"),
    ("auth", "api_keys_file", '"/etc/pd-appliance/missing"',
     "auth.api_keys_file: /etc/pd-appliance/missing is missing or empty"),
    # [proxy]: the proxy's own settings, each checked by its ProxySettings field
    ("proxy", "max_inflight", "3", "proxy.max_inflight: unknown key"),
    ("proxy", "max_queued", "-1",
     "proxy.max_queued: Input should be greater than or equal to 0"),
    ("proxy", "split", '"sometimes"', "proxy.split: Input should be 'always', 'never' or"),
    ("proxy", "port", "9000", "proxy.port: pdctl sets it from ports.proxy"),
    ("proxy", "prefill_timeout_s", "30",
     "proxy.prefill_timeout_s: pdctl sets it from timeouts.prefill_s"),
]


@pytest.mark.parametrize("section,key,value,message", BAD,
                         ids=[f"{s}.{k}={v}" for s, k, v, _ in BAD])
def test_bad_value_is_one_line_and_exit_2(pdctl, write_config, section, key, value, message):
    path = write_config(edit(GOOD_TOML, section, key, value))
    res = pdctl("validate", "--config", str(path))
    assert res.exit_code == 2, res.output
    lines = error_lines(res)
    assert all(line.startswith(f"pdctl: error: {path}: ") for line in lines), lines
    assert any(message in line for line in lines), lines
    assert "Traceback" not in res.output


def test_every_problem_gets_its_own_line(pdctl, write_config):
    text = edit(edit(GOOD_TOML, "ports", "decode", "8010"), "gpus", "decode", "[0]")
    res = pdctl("validate", "--config", str(write_config(text)))
    assert res.exit_code == 2
    lines = error_lines(res)
    assert len(lines) == 2 and "ports.decode" in lines[0] and "gpus.decode" in lines[1]


def test_host_problems_each_on_a_line(pdctl, write_config):
    text = edit(edit(GOOD_TOML, "gpus", "decode", "[7]"), "transfer", "device", '"mlx5_3"')
    res = pdctl("validate", "--config", str(write_config(text)))
    assert res.exit_code == 2
    lines = error_lines(res)
    assert len(lines) == 2
    assert "GPU 7 does not exist" in lines[0] and "unknown RDMA device 'mlx5_3'" in lines[1]


def test_skip_host_checks_accepts_what_only_this_host_lacks(pdctl, write_config):
    path = write_config(edit(GOOD_TOML, "gpus", "decode", "[7]"))
    assert pdctl("validate", "--config", str(path), "--skip-host-checks").exit_code == 0


def test_no_gpus_on_host(pdctl, write_config, host, runner):
    import shutil

    shutil.rmtree(host.root / "proc/driver/nvidia/gpus")
    runner.answers.pop(("nvidia-smi",))
    res = pdctl("validate", "--config", str(write_config(GOOD_TOML)))
    assert res.exit_code == 2
    assert "gpus: no NVIDIA GPU found on this host" in res.stderr


def test_gpus_from_proc_when_nvidia_smi_is_missing(pdctl, write_config, runner):
    runner.answers.pop(("nvidia-smi",))
    assert pdctl("validate", "--config", str(write_config(GOOD_TOML))).exit_code == 0
    res = pdctl("validate", "--config", str(write_config(edit(GOOD_TOML, "gpus", "decode",
                                                               "[2]"))))
    assert "GPU 2 does not exist on this host (GPUs: 0, 1)" in res.stderr


@pytest.mark.parametrize("text,message", [
    ("[host\nip = 1", "invalid TOML"),
    ("", "host: required"),
    ("[model]\npath = \"/models/qwen\"\n", "host: required"),
])
def test_unreadable_configs(pdctl, write_config, text, message):
    res = pdctl("validate", "--config", str(write_config(text)))
    assert res.exit_code == 2 and message in res.stderr


def test_missing_config_file(pdctl, tmp_path):
    res = pdctl("validate", "--config", str(tmp_path / "nope.toml"))
    assert res.exit_code == 2
    assert res.stderr.strip() == (f"pdctl: error: {tmp_path / 'nope.toml'}: no such config file "
                                  f"(write one with `pdctl init`)")


def test_config_path_from_environment(pdctl, write_config):
    path = write_config(GOOD_TOML)
    res = pdctl("validate", env={"PDCTL_CONFIG": str(path)})
    assert res.exit_code == 0 and str(path) in res.stdout


def test_usage_errors_are_one_line_exit_2(pdctl):
    res = pdctl("frobnicate")
    assert res.exit_code == 2 and len(error_lines(res)) == 1
    assert res.stderr.startswith("pdctl: error: No such command 'frobnicate'")
    res = pdctl("up", "--local", "--port", "eighty")
    assert res.exit_code == 2 and len(error_lines(res)) == 1
    assert "Invalid value for '--port'" in res.stderr


def test_toml_round_trip():
    cfg = parse_config({"host": {"ip": "10.0.0.11", "name": "n"},
                        "model": {"path": "/m/x", "extra_args": ["--enable-prefix-caching"]},
                        "transfer": {"protocol": "tcp"}, "ports": {"proxy": 9000},
                        "proxy": {"split": "never", "max_queued": 8, "log_requests": False,
                                  "upstream_ca_file": "/etc/ca.pem"}})
    import tomllib

    again = HostConfig.model_validate(tomllib.loads(to_toml(cfg)))
    assert again == cfg
