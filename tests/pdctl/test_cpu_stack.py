"""stack = "cpu": config problems, init on a host without GPUs, the rendered compose model
(compose.yaml plus compose.override.yaml, read as a plain `docker compose` does), doctor."""

from __future__ import annotations

import json

import pytest

from appliance.kvbudget import MIB
from appliance.pdctl.config.hostconfig import parse_config
from appliance.pdctl.config.toml import to_toml
from appliance.pdctl.errors import ConfigError
from appliance.pdctl.host.doctor import run_checks, version_tuple
from appliance.pdctl.host.probe import HostProbe, parse_cpu_list, split_cpus
from appliance.process import KV_EVENTS_FLAGS
from tests.pdctl.conftest import error_lines
from tests.pdctl.test_render import flag, resolved

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def cpu_toml(model: str, extra: str = "") -> str:
    return f"""\
stack = "cpu"

[host]
name = "box"
ip = "127.0.0.1"

[model]
path = "{model}"
max_model_len = 2048
{extra}
[cpus]
prefill = [0, 1]
decode = [2, 3]

[transfer]
protocol = "tcp"
"""


@pytest.fixture
def model_dir(tmp_path):
    """A model directory with the kvbench shape (48 KiB of KV per token)."""
    d = tmp_path / "models" / "bench"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 8,
         "head_dim": 128, "hidden_size": 256, "torch_dtype": "bfloat16",
         "max_position_embeddings": 4096}))
    return d


def base(**over) -> dict:
    data = {"stack": "cpu", "host": {"ip": "127.0.0.1"}, "model": {"path": "/m"},
            "cpus": {"prefill": [0], "decode": [1]}, "transfer": {"protocol": "tcp"}}
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value.lines


def test_cpu_defaults_block_32_and_the_cpu_image():
    cfg = parse_config(base())
    assert (cfg.block_size, cfg.vllm_image) == (32, "pd-appliance/vllm-cpu:0.1.0")
    gpu = parse_config({"host": {"ip": "10.0.0.1"}, "model": {"path": "/m"},
                        "transfer": {"device": "mlx5_0"}})
    assert (gpu.block_size, gpu.vllm_image) == (16, "pd-appliance/vllm:0.1.0")
    # D's prefill chunk per stack, and 0 (no cap) when asked
    assert (cfg.decode_prefill_chunk, gpu.decode_prefill_chunk) == (128, 512)
    assert parse_config(base(model={"path": "/m", "decode_prefill_chunk": 0})
                        ).decode_prefill_chunk == 0
    # each engine's step budget per stack (0: vLLM's own), and what was asked
    assert (cfg.max_num_batched_tokens, gpu.max_num_batched_tokens) == (256, 0)
    for asked in (0, 1024):
        assert parse_config(base(model={"path": "/m", "max_num_batched_tokens": asked})
                            ).max_num_batched_tokens == asked


def test_cpu_stack_problems_each_on_a_line():
    assert problems(base(transfer={"protocol": "rdma"})) == [
        'transfer.protocol: must be "tcp" with stack "cpu" (RDMA moves GPU memory; the CPU '
        'build moves KV over TCP)']
    assert problems(base(model={"path": "/m", "block_size": 16})) == [
        'model.block_size: 16 with stack "cpu" (the CPU attention backend needs a multiple '
        'of 32)']
    assert problems(base(cpus={"prefill": [0, 1], "decode": [1, 2]})) == [
        "cpus.decode: CPU 1 is also in cpus.prefill (P and D need CPUs of their own: D spins "
        "while it waits for KV)"]
    assert problems(base(model={"path": "/m", "max_num_batched_tokens": 64})) == [
        "model.max_num_batched_tokens: 64 is less than vLLM's 128 requests a step on CPU (0: "
        "vLLM's own budget)"]
    lines = problems(base(cpus={"prefill": [], "decode": []}))
    assert [line.split(":")[0] for line in lines] == ["cpus.prefill", "cpus.decode"]
    gpu = {"host": {"ip": "10.0.0.1"}, "model": {"path": "/m", "kv_cache_bytes": 1 << 30},
           "transfer": {"protocol": "tcp"}}
    assert problems(gpu)[0].startswith("model.kv_cache_bytes: only for stack \"cpu\"")
    assert problems(base(stack="tpu"))[0].startswith("stack: Input should be 'gpu' or 'cpu'")


def test_cpu_config_round_trips_through_toml():
    cfg = parse_config(base(model={"path": "/m", "kv_cache_bytes": 256 * MIB}))
    text = to_toml(cfg)
    assert "\nstack = \"cpu\"\n" in text and "[cpus]" in text and "[gpus]" not in text
    assert parse_config(tomllib.loads(text)) == cfg


def test_cpu_lists_and_the_split():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    assert split_cpus([0, 1]) == ((0,), (1,))
    assert split_cpus(list(range(16)), most=16) == (tuple(range(8)), tuple(range(8, 16)))
    assert split_cpus([5]) == (None, None)


def test_init_on_a_host_without_gpus_picks_the_cpu_stack(pdctl, host, runner, tmp_path):
    host.cpu_only(runner)
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--host-ip", "127.0.0.1")
    assert res.exit_code == 0, res.output
    assert "stack cpu, P CPUs [0, 1, 2, 3], D CPUs [4, 5, 6, 7], tcp" in res.stdout
    cfg = parse_config(tomllib.loads(out.read_text()))
    assert cfg.stack == "cpu" and cfg.transfer.protocol == "tcp"
    assert (cfg.cpus.prefill, cfg.cpus.decode) == ([0, 1, 2, 3], [4, 5, 6, 7])
    # validate and render need no extra flags on this host
    assert pdctl("validate", "--config", str(out)).exit_code == 0


def test_init_stack_cpu_on_a_gpu_host_with_explicit_cpus(pdctl, tmp_path):
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--stack", "cpu",
                "--prefill-cpus", "2", "--decode-cpus", "5,6", "--kv-cache-bytes",
                str(512 * MIB), "--max-model-len", "4096", "--proxy-port", "18000",
                "--bootstrap-port", "18998")
    assert res.exit_code == 0, res.output
    cfg = parse_config(tomllib.loads(out.read_text()))
    assert cfg.ports.model_dump() == {"proxy": 18000, "prefill": 8010, "decode": 8020,
                                      "bootstrap": 18998}
    assert (cfg.stack, cfg.cpus.prefill, cfg.cpus.decode) == ("cpu", [2], [5, 6])
    assert (cfg.model.kv_cache_bytes, cfg.model.max_model_len) == (512 * MIB, 4096)


def test_init_stack_cpu_needs_two_cpus(pdctl, host, runner, tmp_path):
    host.cpu_only(runner)
    (host.root / "sys/devices/system/cpu/online").write_text("0\n")
    res = pdctl("init", "--out", str(tmp_path / "h.toml"), "--model", "/models/qwen",
                "--host-ip", "127.0.0.1")
    assert res.exit_code == 2
    assert error_lines(res) == ["pdctl: error: stack cpu needs two CPUs at least (this host "
                                "has 1), or --prefill-cpus and --decode-cpus"]


def test_validate_names_cpus_the_host_does_not_have(pdctl, host, runner, write_config,
                                                    model_dir):
    host.cpu_only(runner)
    (host.root / "sys/devices/system/cpu/online").write_text("0-2\n")
    (host.root / str(model_dir).lstrip("/")).mkdir(parents=True)
    (host.root / str(model_dir).lstrip("/") / "config.json").write_text("{}")
    res = pdctl("validate", "--config", str(write_config(cpu_toml(str(model_dir)))))
    assert res.exit_code == 2
    assert error_lines(res)[0].endswith("cpus.decode: CPU 3 is not online on this host "
                                        "(online: 0, 1, 2)")


def test_render_cpu_stack_for_a_plain_docker_compose(pdctl, write_config, model_dir):
    path = write_config(cpu_toml(str(model_dir), 'extra_args = ["--enforce-eager"]\n'))
    res = pdctl("render", "--config", str(path), "--skip-host-checks")
    assert res.exit_code == 0, res.output
    out = path.parent
    assert {p.name for p in out.iterdir()} >= {".env", "compose.yaml",
                                               "compose.override.yaml", "pd-appliance.service"}
    services = resolved(out)["services"]  # run in `out` with no flags, as users type it
    for role, cpus in (("prefill", "0,1"), ("decode", "2,3")):
        svc = services[role]
        assert svc["image"] == "pd-appliance/vllm-cpu:0.1.0"
        for gone in ("deploy", "ulimits", "cap_add", "devices"):
            assert gone not in svc, (role, gone)
        assert svc["cpuset"] == cpus
        assert svc["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == cpus
        assert svc["environment"]["PD_PROTOCOL"] == "tcp"
        argv = svc["command"]
        assert flag(argv, "--block-size") == "32"
        assert flag(argv, "--max-model-len") == "2048"
        # sized from the model: 4 requests x 2048 tokens x 48 KiB
        assert flag(argv, "--kv-cache-memory-bytes") == str(384 * MIB)
        assert flag(argv, "--max-num-batched-tokens") == "256"  # the CPU stack's, both roles
        assert "--enforce-eager" in argv
        assert "start_interval" not in svc["healthcheck"]
        # KV events for the proxy's prefix index, as a local node's P and D publish them
        at = argv.index("--kv-events-config")
        assert argv[at - 2:at + 2] == list(KV_EVENTS_FLAGS)


def test_render_cpu_kv_bytes_from_the_config_and_a_model_it_cannot_size(pdctl, write_config,
                                                                         tmp_path):
    path = write_config(cpu_toml("/nowhere/model", f"kv_cache_bytes = {200 * MIB}\n"))
    assert pdctl("render", "--config", str(path), "--skip-host-checks").exit_code == 0
    argv = resolved(path.parent)["services"]["decode"]["command"]
    assert flag(argv, "--kv-cache-memory-bytes") == str(200 * MIB)
    path = write_config(cpu_toml("/nowhere/model"))
    res = pdctl("render", "--config", str(path), "--skip-host-checks")
    assert res.exit_code == 2
    assert error_lines(res)[0].startswith("pdctl: error: model.kv_cache_bytes: cannot size the "
                                          "KV cache from the model (/nowhere/model/config.json:")


def test_switching_back_to_the_gpu_stack_removes_the_override(pdctl, write_config, model_dir):
    from tests.pdctl.conftest import GOOD_TOML

    path = write_config(cpu_toml(str(model_dir)))
    assert pdctl("render", "--config", str(path), "--skip-host-checks").exit_code == 0
    assert (path.parent / "compose.override.yaml").exists()
    path.write_text(GOOD_TOML)
    assert pdctl("render", "--config", str(path)).exit_code == 0
    assert not (path.parent / "compose.override.yaml").exists()
    prefill = resolved(path.parent)["services"]["prefill"]
    assert prefill["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert prefill["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_doctor_on_a_cpu_host_skips_gpu_and_rdma_and_checks_cpus(host, runner, model_dir):
    host.cpu_only(runner)
    cfg = parse_config(tomllib.loads(cpu_toml(str(model_dir))))
    checks = {c.name: c for c in run_checks(cfg, HostProbe(host.root, runner))}
    for name in ("GPUs", "RDMA device", "memlock", "NVIDIA container runtime"):
        assert checks[name].status == "skip", name
    assert checks["CPUs"].status == "pass"
    assert checks["CPUs"].detail == "prefill 0, 1, decode 2, 3 (8 online)"
    (host.root / "sys/devices/system/cpu/online").write_text("0-1\n")
    checks = {c.name: c for c in run_checks(cfg, HostProbe(host.root, runner))}
    assert checks["CPUs"].status == "fail"
    assert "CPU 2 (cpus.decode), CPU 3 (cpus.decode) not online" in checks["CPUs"].detail


@pytest.mark.parametrize("engine, compose, failing", [
    ("20.10.24+dfsg1", "2.40.3", set()),
    ("19.03.15", "2.40.3", {"docker"}),
    ("28.2.2", "2.20.0", {"docker compose"}),
])
def test_doctor_checks_engine_and_compose_versions(host, runner, engine, compose, failing):
    runner.answer(["docker", "version"], engine + "\n")
    runner.answer(["docker", "compose", "version"], compose + "\n")
    checks = run_checks(None, HostProbe(host.root, runner))
    bad = {c.name for c in checks if c.status == "fail" and c.name.startswith("docker")}
    assert bad == failing
    if "docker" in failing:
        assert next(c for c in checks if c.name == "docker").detail == \
            "Engine 19.03.15: compose.yaml needs Engine 20.10 or later"


def test_version_tuple():
    assert version_tuple("v2.40.3") == (2, 40, 3)
    assert version_tuple("20.10.24+dfsg1") == (20, 10, 24)
    assert version_tuple("28.0.1-1") == (28, 0, 1)
    assert version_tuple("garbage") == ()
