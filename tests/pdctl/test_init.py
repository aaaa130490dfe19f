"""`pdctl init`: detection from the fake host, no prompts when flags are given."""

from __future__ import annotations

import json
import shutil

from appliance.pdctl.config.hostconfig import load_config
from tests.pdctl.conftest import error_lines


def test_init_detects_gpus_rdma_and_address(pdctl, tmp_path):
    out = tmp_path / "etc" / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--name", "node1")
    assert res.exit_code == 0, res.output
    assert "GPUs: 2" in res.stdout and "RDMA: mlx5_0 (port 1 ACTIVE 200 Gb/sec (4X HDR))" \
        in res.stdout
    cfg = load_config(out)
    assert cfg.host.ip == "192.168.1.20"  # the default route's eno1, not InfiniBand's ib0
    assert (cfg.gpus.prefill, cfg.gpus.decode) == ([0], [1])
    assert (cfg.transfer.protocol, cfg.transfer.gpudirect) == ("rdma", "auto")
    assert (cfg.transfer.prefill_devices, cfg.transfer.decode_devices) == (["mlx5_0"],
                                                                            ["mlx5_0"])
    assert cfg.model.path == "/models/qwen" and cfg.model.name == "qwen"


def test_init_tp2_and_explicit_values(pdctl, tmp_path, host, runner):
    runner.answer(["nvidia-smi"], "".join(f"{i}, NVIDIA H100, 0000:{i:02x}:00.0, 81559\n"
                                          for i in range(4)))
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--tp-size", "2",
                "--host-ip", "10.1.2.3", "--protocol", "tcp")
    assert res.exit_code == 0, res.output
    cfg = load_config(out)
    assert (cfg.gpus.prefill, cfg.gpus.decode, cfg.model.tp_size) == ([0, 1], [2, 3], 2)
    assert cfg.host.ip == "10.1.2.3" and cfg.transfer.protocol == "tcp"
    assert cfg.transfer.device == ""


def test_init_p_and_d_of_different_tp(pdctl, tmp_path, host, runner):
    runner.answer(["nvidia-smi"], "".join(f"{i}, NVIDIA H100, 0000:{i:02x}:00.0, 81559\n"
                                          for i in range(4)))
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--prefill-tp-size", "1",
                "--decode-tp-size", "2", "--host-ip", "10.1.2.3", "--protocol", "tcp")
    assert res.exit_code == 0, res.output
    cfg = load_config(out)
    assert (cfg.gpus.prefill, cfg.gpus.decode) == ([0], [1, 2])
    assert (cfg.model.tp("prefill"), cfg.model.tp("decode")) == (1, 2)


def test_init_without_active_rdma_port_picks_tcp(pdctl, tmp_path, host):
    host.port_down()
    out = tmp_path / "host.toml"
    assert pdctl("init", "--out", str(out), "--model", "/models/qwen").exit_code == 0
    assert load_config(out).transfer.protocol == "tcp"


def test_init_leaves_gpudirect_to_the_preflight_and_doctor_finds_dmabuf(pdctl, tmp_path, host):
    """A DMA-BUF-only host (no nvidia_peermem, open kernel modules): init writes auto, the
    containers' preflight takes DMA-BUF, and doctor says so; --gpudirect pins a path."""
    host.no_peermem()
    host.open_kernel_modules()
    out = tmp_path / "host.toml"
    assert pdctl("init", "--out", str(out), "--model", "/models/qwen").exit_code == 0
    assert load_config(out).transfer.gpudirect == "auto"
    res = pdctl("doctor", "--config", str(out), "--json")
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["GPUDirect RDMA"]["detail"].startswith("DMA-BUF usable")
    pinned = tmp_path / "pinned.toml"
    assert pdctl("init", "--out", str(pinned), "--model", "/models/qwen",
                 "--gpudirect", "peermem").exit_code == 0
    assert load_config(pinned).transfer.gpudirect == "peermem"


def test_init_rejects_a_gpu_the_host_lacks(pdctl, tmp_path):
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen", "--decode-gpus", "4")
    assert res.exit_code == 2
    assert error_lines(res) == ["pdctl: error: gpus.decode: GPU 4 does not exist on this host "
                                "(GPUs: 0, 1)"]
    assert not out.exists()


def test_init_rejects_unknown_rdma_device(pdctl, tmp_path):
    res = pdctl("init", "--out", str(tmp_path / "h.toml"), "--model", "/models/qwen",
                "--rdma-device", "mlx5_7")
    assert res.exit_code == 2 and "unknown RDMA device 'mlx5_7'" in res.stderr


def test_init_warns_about_a_model_not_downloaded_yet(pdctl, tmp_path):
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/later")
    assert res.exit_code == 0
    assert "warning: model.path: /models/later does not exist" in res.stdout


def test_init_needs_model_without_a_terminal(pdctl, tmp_path):
    res = pdctl("init", "--out", str(tmp_path / "h.toml"))
    assert res.exit_code == 2
    assert error_lines(res) == ["pdctl: error: --model is required (the model directory on "
                                "this host)"]


def test_init_does_not_overwrite(pdctl, tmp_path):
    out = tmp_path / "host.toml"
    out.write_text("keep me")
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen")
    assert res.exit_code == 2 and "exists (use --force" in res.stderr
    assert out.read_text() == "keep me"
    assert pdctl("init", "--out", str(out), "--model", "/models/qwen", "--force").exit_code == 0


def test_init_on_a_host_without_nvidia_smi_or_rdma(pdctl, tmp_path, host, runner):
    runner.answers.pop(("nvidia-smi",))
    shutil.rmtree(host.root / "sys/class/infiniband")
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen")
    assert res.exit_code == 0, res.output
    assert "RDMA: no devices" in res.stdout
    assert load_config(out).transfer.protocol == "tcp"


def _ip(*addrs: tuple[str, str]) -> str:
    return json.dumps([{"ifname": dev, "addr_info": [{"local": ip, "scope": "global"}]}
                       for dev, ip in addrs])


def test_init_on_an_infiniband_host_takes_the_default_routes_address(pdctl, tmp_path, runner):
    """ib0 is IPoIB: clients, the proxy and Ethernet-only peers may not reach it."""
    runner.answer(["ip"], _ip(("ib0", "10.0.0.11"), ("eno1", "172.16.0.5"),
                              ("eno2", "192.168.1.20")))
    runner.answer(["ip", "-j", "route"], json.dumps([{"dst": "default", "dev": "eno2"}]))
    out = tmp_path / "host.toml"
    res = pdctl("init", "--out", str(out), "--model", "/models/qwen")
    assert res.exit_code == 0, res.output
    assert load_config(out).host.ip == "192.168.1.20"
    said = " ".join(res.stdout.split())
    assert "addresses: host.ip 192.168.1.20 (eno2, the default route's interface; not " \
           "mlx5_0's IPoIB netdev) serves P, D, the bootstrap sidecar and the side channels; " \
           "the proxy listens on compose.bind (0.0.0.0:8000); Mooncake's handshake goes to " \
           "host.ip, the KV over RDMA by each NIC's GID" in said


def test_init_on_a_roce_host_takes_the_nics_address(tmp_path):
    """RoCE: the NIC's netdev is plain Ethernet, the address P and D should share."""
    from click.testing import CliRunner

    from appliance.pdctl.cli import cli
    from tests.pdctl.fake_topology import workstation
    from tests.pdctl.fakes import env_for

    host, runner = workstation(tmp_path / "root")  # default route: eno1, 192.168.1.20
    out = tmp_path / "host.toml"
    res = CliRunner().invoke(cli, ["init", "--out", str(out), "--model", "/models/qwen"],
                             obj=env_for(host.root, runner))
    assert res.exit_code == 0, res.output
    assert load_config(out).host.ip == "10.1.0.5"
    assert "host.ip 10.1.0.5 (enp5s0np0, the RDMA NIC's netdev)" in res.stdout


def test_init_without_rdma_takes_the_default_routes_address(pdctl, tmp_path, runner):
    runner.answer(["ip"], _ip(("docker0", "172.17.0.1"), ("eno1", "192.168.1.20")))
    out = tmp_path / "host.toml"
    assert pdctl("init", "--out", str(out), "--model", "/models/qwen", "--protocol",
                 "tcp").exit_code == 0
    assert load_config(out).host.ip == "192.168.1.20"
