"""Which NIC each GPU uses: the distance arithmetic, then `pdctl init` and `pdctl doctor` on
fake PCIe trees (a workstation, an HGX H100)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from appliance.pdctl.cli import cli
from appliance.pdctl.config.hostconfig import load_config
from appliance.pdctl.host.topology import (
    Distance,
    GpuSite,
    Nic,
    PciLocation,
    acs_flags,
    assign_nics,
    distance,
    normalize_bus_id,
    parse_sysfs_path,
    role_devices,
)
from tests.pdctl.fake_topology import (
    HGX_NICS,
    HGX_STORAGE,
    hgx_h100,
    hgx_switch_port,
    workstation,
)
from tests.pdctl.fakes import FakeRunner, env_for

RP, USP = "0000:17:01.0", "0000:18:00.0"


def loc(*chain: str, root: str = "pci0000:17", numa: int = 0) -> PciLocation:
    return PciLocation(root, chain[:-1], chain[-1], numa)


# ---- arithmetic ------------------------------------------------------------------------

def test_distance_classes():
    gpu = loc(RP, USP, "0000:19:00.0", "0000:1a:00.0")
    assert distance(gpu, loc(RP, USP, "0000:19:01.0", "0000:1b:00.0")) is Distance.PIX
    nested = loc(RP, USP, "0000:19:02.0", "0000:20:00.0", "0000:21:00.0", "0000:22:00.0")
    assert distance(gpu, nested) is Distance.PXB
    assert distance(gpu, loc("0000:17:02.0", "0000:30:00.0")) is Distance.PHB
    other_bridge = loc("0000:26:01.0", "0000:27:00.0", root="pci0000:26")
    assert distance(gpu, other_bridge) is Distance.NODE
    assert distance(gpu, loc("0000:95:01.0", "0000:96:00.0", root="pci0000:95",
                             numa=1)) is Distance.SYS
    assert distance(gpu, loc("0000:95:01.0", "0000:96:00.0", root="pci0000:95",
                             numa=-1)) is Distance.NODE  # NUMA not reported: one socket
    assert distance(gpu, None) is Distance.UNKNOWN


def test_sysfs_paths_and_bus_ids():
    path = "/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0/0000:1b:00.0/" \
           "infiniband/mlx5_0"
    assert parse_sysfs_path(path, 0) == PciLocation(
        "pci0000:17", ("0000:17:01.0", "0000:18:00.0", "0000:19:01.0"), "0000:1b:00.0", 0)
    assert parse_sysfs_path("/sys/devices/virtual/infiniband/rxe0") is None
    assert normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert normalize_bus_id("0000:1a:00.0") == "0000:1a:00.0"


def _switch(n: int) -> tuple[PciLocation, ...]:
    """A GPU and its switch's other three downstream ports' devices."""
    base = (f"0000:{0x10 * n:02x}:01.0", f"0000:{0x10 * n + 1:02x}:00.0")
    root = f"pci0000:{0x10 * n:02x}"
    return tuple(loc(*base, f"0000:{0x10 * n + 2:02x}:0{i}.0",
                     f"0000:{0x10 * n + 3 + i:02x}:00.0", root=root) for i in range(4))


def test_natural_name_order_breaks_ties():
    gpu, a, b, _ = _switch(1)
    nics = [Nic("mlx5_10", a, 400), Nic("mlx5_2", b, 400)]
    choices = assign_nics({"prefill": [GpuSite(0, gpu)]}, nics)
    assert role_devices(choices, "prefill") == ["mlx5_2"]


def test_faster_nic_breaks_ties_and_a_far_one_is_never_chosen():
    gpu, a, b, _ = _switch(1)
    far = PciLocation("pci0000:90", ("0000:90:01.0",), "0000:91:00.0", 1)
    nics = [Nic("mlx5_0", far, 800), Nic("mlx5_1", a, 200), Nic("mlx5_2", b, 400)]
    assert assign_nics({"decode": [GpuSite(3, gpu)]}, nics)[0].nic == "mlx5_2"
    # Down ports do not count: the far NIC only when nothing nearer is ACTIVE.
    down = [Nic("mlx5_0", far, 800), Nic("mlx5_1", a, 200, active=False)]
    choice = assign_nics({"decode": [GpuSite(3, gpu)]}, down)[0]
    assert (choice.nic, choice.distance) == ("mlx5_0", Distance.SYS)


def test_p_and_d_take_distinct_nics_when_equally_near():
    gpu_p, gpu_d, a, b = _switch(1)
    nics = [Nic("mlx5_0", a, 400), Nic("mlx5_1", b, 400)]
    choices = assign_nics({"prefill": [GpuSite(0, gpu_p)], "decode": [GpuSite(1, gpu_d)]},
                          nics)
    assert [(c.role, c.gpu, c.nic) for c in choices] == [("prefill", 0, "mlx5_0"),
                                                          ("decode", 1, "mlx5_1")]
    # One NIC near both: they share it rather than take a farther one.
    shared = assign_nics({"prefill": [GpuSite(0, gpu_p)], "decode": [GpuSite(1, gpu_d)]},
                         [Nic("mlx5_0", a, 400), Nic("mlx5_9", _switch(2)[1], 400)])
    assert [c.nic for c in shared] == ["mlx5_0", "mlx5_0"]


def test_acs_flags():
    assert acs_flags(0x1D) == ["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]
    assert acs_flags(0) == []


# ---- pdctl init on fake trees -----------------------------------------------------------

def _pdctl(host_runner: tuple, *args: str) -> Result:
    host, runner = host_runner
    return CliRunner().invoke(cli, list(args), obj=env_for(host.root, runner))


def _init(tmp_path: Path, host_runner: tuple, *args: str) -> tuple[Result, Path]:
    out = tmp_path / "host.toml"
    res = _pdctl(host_runner, "init", "--out", str(out), "--model", "/models/qwen", *args)
    assert res.exit_code == 0, res.output
    return res, out


def test_workstation_takes_the_switchmate_not_the_first_name(tmp_path):
    """bnxt_re0 sorts first and is ACTIVE, but it sits on the chipset's root port."""
    res, out = _init(tmp_path, workstation(tmp_path / "root"))
    t = load_config(out).transfer
    assert (t.prefill_devices, t.decode_devices, t.device) == (["mlx5_0"], ["mlx5_0"], "")
    assert "RDMA for prefill: GPU 0 → mlx5_0 (PIX: same PCIe switch)" in res.stdout
    assert "RDMA for decode: GPU 1 → mlx5_0 (PIX: same PCIe switch)" in res.stdout


@pytest.fixture
def hgx(tmp_path) -> tuple:
    return hgx_h100(tmp_path / "root")


def test_hgx_each_role_gets_its_gpus_switchmates_in_gpu_order(tmp_path, hgx):
    res, out = _init(tmp_path, hgx, "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7",
                     "--tp-size", "4")
    t = load_config(out).transfer
    assert t.prefill_devices == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert t.decode_devices == ["mlx5_6", "mlx5_7", "mlx5_10", "mlx5_11"]  # not name order
    assert not set(HGX_STORAGE) & set(t.prefill_devices + t.decode_devices)
    assert "GPU 6 → mlx5_10 (PIX: same PCIe switch)" in " ".join(res.stdout.split())


def test_hgx_1p1d_on_neighbour_gpus(tmp_path, hgx):
    _res, out = _init(tmp_path, hgx)
    t = load_config(out).transfer
    assert (t.prefill_devices, t.decode_devices) == (["mlx5_0"], ["mlx5_1"])


def test_hgx_gpu_whose_nic_is_down_leaves_the_neighbours_nic_alone(tmp_path, hgx):
    host, _runner = hgx
    (host.root / "sys/class/infiniband/mlx5_0/ports/1/state").write_text("1: DOWN\n")
    res, out = _init(tmp_path, hgx)
    t = load_config(out).transfer
    # GPU 0's nearest are socket 0's other NICs (NODE): the fastest not taken by GPU 1.
    assert (t.prefill_devices, t.decode_devices) == (["mlx5_2"], ["mlx5_1"])
    assert "GPU 0 → mlx5_2 (NODE" in res.stdout


def test_rdma_device_pins_one_nic_for_both(tmp_path, hgx):
    res, out = _init(tmp_path, hgx, "--rdma-device", "mlx5_4")
    t = load_config(out).transfer
    assert (t.device, t.prefill_devices, t.decode_devices) == ("mlx5_4", [], [])
    assert "RDMA: mlx5_4 for P and D (--rdma-device)" in res.stdout


# ---- pdctl doctor on fake trees ----------------------------------------------------------

def _config(tmp_path: Path, prefill: list[str], decode: list[str], p: str = "[0]",
            d: str = "[1]") -> Path:
    path = tmp_path / "etc" / "host.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'[host]\nip = "192.168.1.20"\n[model]\npath = "/models/qwen"\n'
                    f"[gpus]\nprefill = {p}\ndecode = {d}\n[transfer]\n"
                    f"prefill_devices = {json.dumps(prefill)}\n"
                    f"decode_devices = {json.dumps(decode)}\n")
    return path


def _doctor(hgx: tuple, path: Path) -> tuple[int, dict[str, dict]]:
    res = _pdctl(hgx, "doctor", "--config", str(path), "--json")
    return res.exit_code, {c["name"]: c for c in json.loads(res.stdout)["checks"]}


def test_doctor_shows_each_roles_nics_and_warns_on_a_far_one(tmp_path, hgx):
    code, checks = _doctor(hgx, _config(tmp_path, ["mlx5_0"], ["mlx5_1"]))
    assert code == 0
    assert checks["NICs (prefill)"] == {"name": "NICs (prefill)", "status": "pass",
                                        "detail": "GPU 0 → mlx5_0 PIX", "fix": ""}
    assert checks["NICs (decode)"]["detail"] == "GPU 1 → mlx5_1 PIX"
    code, checks = _doctor(hgx, _config(tmp_path, ["mlx5_6"], ["mlx5_1"]))
    check = checks["NICs (prefill)"]
    assert code == 0 and check["status"] == "warn"  # slow, not broken
    assert check["detail"].startswith("GPU 0 → mlx5_6 SYS")
    assert check["fix"].startswith("list mlx5_0 (PIX) for GPU 0 in transfer.prefill_devices")


def _setpci(runner: FakeRunner, acs: dict[str, str]) -> None:
    # A port without the ACS capability: setpci says so and exits 1.
    runner.answer(["setpci"], "", 1, "setpci: Capability ACS not found\n")
    for bdf, value in acs.items():
        runner.answer(["setpci", "-s", bdf], value + "\n")


def test_doctor_warns_about_acs_redirect_between_a_gpu_and_its_nic(tmp_path, hgx):
    _host, runner = hgx
    path = _config(tmp_path, ["mlx5_0"], ["mlx5_1"])
    code, checks = _doctor(hgx, path)
    assert checks["PCIe ACS"]["status"] == "skip" and "setpci not found" in \
        checks["PCIe ACS"]["detail"]
    ports = [hgx_switch_port(g, nic) for g in (0, 1) for nic in (False, True)]
    _setpci(runner, dict.fromkeys(ports, "0000"))
    code, checks = _doctor(hgx, path)
    assert checks["PCIe ACS"]["status"] == "pass"
    assert checks["PCIe ACS"]["detail"] == "no ACS redirect on the 4 switch ports between " \
                                           "GPUs and NICs"
    _setpci(runner, {**dict.fromkeys(ports, "0000"), hgx_switch_port(0, True): "001d"})
    code, checks = _doctor(hgx, path)
    check = checks["PCIe ACS"]
    assert code == 0 and check["status"] == "warn"
    assert check["detail"] == (f"ACS redirect on {hgx_switch_port(0, True)} (GPU 0-mlx5_0: "
                               "SrcValid+ReqRedir+CmpltRedir+UpstreamFwd): GPUDirect RDMA goes "
                               "through the root complex")
    assert f"setpci -s {hgx_switch_port(0, True)} ECAP_ACS+6.w=0000" in check["fix"]
    assert f"pci=disable_acs_redir={hgx_switch_port(0, True)}" in check["fix"]
    assert [c for c in runner.calls if c[0] == "setpci"][-1][-1] == "ECAP_ACS+6.w"


def test_doctor_rejects_a_nic_the_host_lacks(tmp_path, hgx):
    code, checks = _doctor(hgx, _config(tmp_path, ["mlx5_0", "mlx5_12"], ["mlx5_1"]))
    assert code == 1 and checks["RDMA device"]["status"] == "fail"
    assert checks["RDMA device"]["detail"].startswith("mlx5_12 not found (this host has: "
                                                      "mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4")
    assert HGX_NICS[-1] in checks["RDMA device"]["detail"]
