"""`pdctl render --cluster`: every host's config and the shared keys from one description;
each host's own render passes a real Compose v2 `config` check with one service per instance,
each P beside its own sidecar, every D accepting every sidecar, and the proxy's backends as
the plan names them."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from appliance.connector.settings import ConnectorSettings
from appliance.pdctl.config.hostconfig import load_config
from appliance.proxy.settings import load_settings
from tests.pdctl.test_render import flag, kv_config, resolved

TWO_HOSTS = """\
stack = "gpu"
[transfer]
protocol = "rdma"
device = "mlx5_0"
[model]
path = "/models/qwen"
[proxy]
host = "a"
policy = "least_outstanding"
split = "never"
itl_slo_ms = 30
[[hosts]]
name = "a"
ip = "10.0.0.11"
gpus = 4
prefill = [[0], [1]]
decode = [[2]]
[[hosts]]
name = "b"
ip = "10.0.0.12"
gpus = 4
decode = [[0], [3]]
"""

CPU_HOSTS = """\
stack = "cpu"
[model]
path = "/models/qwen"
kv_cache_bytes = 67108864
[proxy]
host = "d"
[[hosts]]
name = "p"
ip = "10.0.0.21"
cpus = 4
prefill = [[0, 1], [2, 3]]
[[hosts]]
name = "d"
ip = "10.0.0.22"
cpus = 2
decode = [[0, 1]]
"""


@pytest.fixture
def cluster(pdctl, tmp_path):
    def render(text: str) -> Path:
        desc = tmp_path / "cluster.toml"
        desc.write_text(text)
        res = pdctl("render", "--cluster", str(desc))
        assert res.exit_code == 0, res.output
        return tmp_path / "cluster"
    return render


def _host(pdctl, out: Path, name: str) -> dict:
    res = pdctl("render", "--config", str(out / name / "host.toml"), "--skip-host-checks")
    assert res.exit_code == 0, res.output
    return resolved(out / name)["services"]


def test_every_host_gets_its_config_and_the_same_keys(cluster, pdctl, tmp_path):
    out = cluster(TWO_HOSTS)
    a, b = load_config(out / "a" / "host.toml"), load_config(out / "b" / "host.toml")
    assert a.cluster is not None and b.cluster is not None
    assert (a.cluster.prefill, a.cluster.decode, a.cluster.proxy) == ([[0], [1]], [[2]], True)
    assert (b.cluster.prefill, b.cluster.decode, b.cluster.proxy) == ([], [[0], [3]], False)
    # P accepts Mooncake sessions at the D hosts' addresses (a D's side channel may leave
    # from another of its addresses); a host without a P needs none
    assert a.host.internal_networks == ["10.0.0.11/32", "10.0.0.12/32"]
    assert b.host.internal_networks == []
    for name in ("api-key", "bootstrap-token", "side-channel.key"):
        first = (out / "a" / "keys" / name).read_bytes()
        assert first == (out / "b" / "keys" / name).read_bytes() == \
            (out / "keys" / name).read_bytes()
        assert stat.S_IMODE((out / "b" / "keys" / name).stat().st_mode) == 0o600
    # a second render keeps the keys (hosts already running keep working)
    again = pdctl("render", "--cluster", str(tmp_path / "cluster.toml"))
    assert again.exit_code == 0
    assert (out / "b" / "keys" / "api-key").read_bytes() == \
        (out / "a" / "keys" / "api-key").read_bytes()


def test_host_with_two_p_one_d_and_the_proxy(cluster, pdctl):
    s = _host(pdctl, cluster(TWO_HOSTS), "a")
    assert set(s) == {"bootstrap-0", "bootstrap-1", "prefill-0", "prefill-1", "decode-0",
                      "proxy"}
    for n in (0, 1):
        p = s[f"prefill-{n}"]
        assert flag(p["command"], "--port") == str(8010 + n)
        extra = kv_config(p["command"])
        assert extra["engine_id"] == f"a-prefill-{n}"
        # each P registers with its own sidecar, which listens where P says
        sidecar = extra["kv_connector_extra_config"]["bootstrap_addr"]
        assert sidecar == f"http://10.0.0.11:{8998 + n}"
        assert flag(s[f"bootstrap-{n}"]["command"], "--port") == str(8998 + n)
        assert list(p["depends_on"]) == [f"bootstrap-{n}"]
        assert p["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [str(n)]
        # each instance's preflight and Mooncake get the role's NICs
        assert p["environment"]["PD_RDMA_DEVICE"] == "mlx5_0"
        assert extra["kv_connector_extra_config"]["device_name"] == "mlx5_0"
    assert s["decode-0"]["environment"]["PD_RDMA_DEVICE"] == "mlx5_0"
    d = kv_config(s["decode-0"]["command"])
    settings = ConnectorSettings(engine_id=d["engine_id"], role="consumer",
                                 allowed_bootstrap_addrs=d["kv_connector_extra_config"][
                                     "allowed_bootstrap_addrs"])
    assert settings.bootstrap_allowed("http://10.0.0.11:8999")
    assert not settings.bootstrap_allowed("http://10.0.0.99:8998")
    assert "depends_on" not in s["decode-0"]
    proxy = load_settings(s["proxy"]["command"][3:])  # past `python -m appliance.proxy`
    assert [(n.url, n.bootstrap_url) for n in proxy.prefill] == [
        ("http://10.0.0.11:8010", "http://10.0.0.11:8998"),
        ("http://10.0.0.11:8011", "http://10.0.0.11:8999")]
    assert [n.url for n in proxy.decode] == ["http://10.0.0.11:8020", "http://10.0.0.12:8020",
                                             "http://10.0.0.12:8021"]
    assert proxy.policy == "least_outstanding"
    assert (proxy.split, proxy.itl_slo_ms) == ("never", 30)
    assert set(s["proxy"]["depends_on"]) == set(s) - {"proxy"}


def test_decode_only_host(cluster, pdctl):
    s = _host(pdctl, cluster(TWO_HOSTS), "b")
    assert set(s) == {"decode-0", "decode-1"}
    for n, gpu in ((0, "0"), (1, "3")):
        d = s[f"decode-{n}"]
        assert flag(d["command"], "--port") == str(8020 + n)
        assert flag(d["command"], "--host") == "10.0.0.12"
        extra = kv_config(d["command"])
        assert extra["engine_id"] == f"b-decode-{n}"
        assert extra["kv_connector_extra_config"]["allowed_bootstrap_addrs"] == [
            "http://10.0.0.11:8998", "http://10.0.0.11:8999"]
        assert d["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [gpu]
        assert "depends_on" not in d


def test_cpu_cluster_pins_each_instance(cluster, pdctl):
    out = cluster(CPU_HOSTS)
    p = _host(pdctl, out, "p")
    assert set(p) == {"bootstrap-0", "bootstrap-1", "prefill-0", "prefill-1"}
    assert (p["prefill-0"]["cpuset"], p["prefill-1"]["cpuset"]) == ("0,1", "2,3")
    assert p["prefill-1"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert "deploy" not in p["prefill-0"] and not p["prefill-0"].get("cap_add")
    assert kv_config(p["prefill-0"]["command"])["kv_connector_extra_config"]["protocol"] == "tcp"
    d = _host(pdctl, out, "d")
    assert set(d) == {"decode-0", "proxy"} and d["decode-0"]["cpuset"] == "0,1"
    assert list(d["proxy"]["depends_on"]) == ["decode-0"]


def test_bad_description_one_line_each_nothing_written(pdctl, tmp_path):
    desc = tmp_path / "cluster.toml"
    desc.write_text(TWO_HOSTS.replace("decode = [[0], [3]]", "decode = [[0], [0]]")
                    .replace('host = "a"', 'host = "z"'))
    res = pdctl("render", "--cluster", str(desc))
    assert res.exit_code == 2
    assert [line for line in res.stderr.splitlines() if line.strip()] == [
        f"pdctl: error: {desc}: hosts[1].decode[1]: GPU 0 is also decode[0] (over-committed)",
        f"pdctl: error: {desc}: proxy.host: z is not one of the hosts (a, b)"]
    assert not (tmp_path / "cluster").exists()


@pytest.mark.parametrize("args, wanted", [
    (["--kubernetes"], "--kubernetes needs --cluster"),
    (["--cluster", "x.toml", "--config", "y.toml"], "give it without --config"),
])
def test_flag_misuse(pdctl, args, wanted):
    res = pdctl("render", *args)
    assert res.exit_code == 2 and wanted in res.stderr


def test_a_hand_edited_cluster_host_is_checked(pdctl, write_config):
    from tests.pdctl.conftest import GOOD_TOML

    path = write_config(GOOD_TOML + "[cluster]\nprefill = [[0]]\ndecode = [[0]]\n"
                        "proxy = true\n")
    res = pdctl("validate", "--config", str(path), "--skip-host-checks")
    assert res.exit_code == 2
    assert "cluster.decode[0]: GPU 0 is also cluster.prefill[0]" in res.stderr
    assert "cluster.prefill_backends / decode_backends: the proxy runs here" in res.stderr
    assert "cluster.sidecars: decode runs here" in res.stderr


def test_host_checks_name_the_instance(cluster, pdctl):
    """The fake host has GPUs 0 and 1: b's decode[1] on GPU 3 is named as the instance."""
    res = pdctl("validate", "--config", str(cluster(TWO_HOSTS) / "b" / "host.toml"))
    assert res.exit_code == 2
    assert "cluster.decode[1]: GPU 3 does not exist on this host" in res.stderr


def test_logs_names_the_hosts_services(cluster, pdctl):
    res = pdctl("logs", "prefill", "--config", str(cluster(TWO_HOSTS) / "b" / "host.toml"))
    assert res.exit_code == 2 and "decode-0, decode-1" in res.stderr


def test_status_on_a_cluster_host_reports_its_instances(cluster, pdctl):
    """Nothing runs: each of b's D instances is reported down, on its own port (loopback
    addresses: status really asks them)."""
    desc = TWO_HOSTS.replace("10.0.0.", "127.0.0.")
    res = pdctl("status", "--json", "--config", str(cluster(desc) / "b" / "host.toml"),
                env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert res.exit_code == 1, res.output
    import json

    status = json.loads(res.stdout)
    assert [(m["name"], m["url"], m["healthy"]) for m in status["members"]] == [
        ("b/decode-0", "http://127.0.0.12:8020", False),
        ("b/decode-1", "http://127.0.0.12:8021", False)]
    assert any(line.startswith("docker: ") for line in status["problems"])


def test_kubernetes_values_for_the_same_cluster(pdctl, tmp_path):
    """--kubernetes also writes the chart's values: the same instance counts and TP, the
    keys left to a Secret made from the same keys/ directory."""
    import yaml

    desc = tmp_path / "cluster.toml"
    desc.write_text(TWO_HOSTS + '[kubernetes]\npod_network_cidrs = ["10.244.0.0/16"]\n')
    res = pdctl("render", "--cluster", str(desc), "--kubernetes")
    assert res.exit_code == 0, res.output
    text = (tmp_path / "cluster" / "values.yaml").read_text()
    values = yaml.safe_load(text)
    assert values["podNetworkCidrs"] == ["10.244.0.0/16"]
    assert (values["prefill"]["replicas"], values["decode"]["replicas"]) == (2, 3)
    assert values["proxy"]["settings"] == {"policy": "least_outstanding", "split": "never",
                                           "itl_slo_ms": 30}
    assert values["keys"]["existingSecret"]
    for key in (tmp_path / "cluster" / "keys").iterdir():
        assert key.read_text().strip() not in text


def test_kubernetes_values_need_the_pod_network(pdctl, tmp_path):
    """Without it D would accept any bootstrap address: one line, exit 2, nothing written;
    the hosts' own render does not need it."""
    desc = tmp_path / "cluster.toml"
    desc.write_text(TWO_HOSTS)
    res = pdctl("render", "--cluster", str(desc), "--kubernetes")
    assert res.exit_code == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "kubernetes.pod_network_cidrs: --kubernetes needs" in lines[0]
    assert not (tmp_path / "cluster").exists()
    assert pdctl("render", "--cluster", str(desc)).exit_code == 0


def test_doctor_checks_the_ports_of_the_hosts_instances(cluster, pdctl, host):
    """b runs decode-0 and decode-1 (8020, 8021), not the proxy: 8021 taken is named."""
    host.listening(8021, 8000)
    res = pdctl("doctor", "--config", str(cluster(TWO_HOSTS) / "b" / "host.toml"))
    line = next(x for x in res.stdout.splitlines() if "ports" in x and "in use" in x)
    assert "8021 (decode-1)" in line and "8000" not in line


def test_a_p_hosts_own_internal_networks_are_kept(cluster):
    """Given for a host (its D reach it from another network), they stand as written."""
    out = cluster(TWO_HOSTS.replace('ip = "10.0.0.11"',
                                    'ip = "10.0.0.11"\ninternal_networks = ["10.1.0.0/16"]'))
    assert load_config(out / "a" / "host.toml").host.internal_networks == ["10.1.0.0/16"]
