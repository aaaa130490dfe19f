"""The chart on a GPU cluster: the RDMA resource the NVIDIA Network Operator creates, the KV
protocol and GPUDirect mode that follow from it, each role's NICs, and P's and D's network
(the pod network, the node's with hostNetwork, or a Multus network for the KV)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from appliance import kvhost
from appliance.connector.settings import ConnectorSettings
from tests.charts.cases import NEEDED, Rendered, merged
from tests.charts.helmtool import CHART
from tests.charts.objects import Doc, container, env, flag, kv_config, pod, workload

ROLES = ("prefill", "decode")
MULTUS = "k8s.v1.cni.cncf.io/networks"
LAUNCHER = ["python3", "-m", "appliance.launcher", "serve"]
NETWORK_OPERATOR_RESOURCE = "rdma/rdma_shared_device_a"


def _vllm(docs: list[Doc], role: str) -> Doc:
    return container(workload(docs, role), "vllm")


def _render(rendered: Rendered, values: dict[str, Any]) -> list[Doc]:
    result = rendered.values(merged(NEEDED, values))
    assert result.rc == 0, result.out
    return result.docs()


def test_the_default_resource_is_the_network_operators(rendered: Rendered) -> None:
    """What NicClusterPolicy's rdmaSharedDevicePlugin creates by default (resourceName
    rdma_shared_device_a, prefix rdma), and on the gpu stack the KV goes over it."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["transfer"]
    assert defaults["rdmaResource"]["name"] == NETWORK_OPERATOR_RESOURCE
    assert (defaults["protocol"], defaults["gpudirect"]) == ("auto", "auto")
    docs = rendered("defaults")
    for role in ROLES:
        c = _vllm(docs, role)
        for kind in ("requests", "limits"):
            assert c["resources"][kind][NETWORK_OPERATOR_RESOURCE] == "1"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert env(c)["PD_PROTOCOL"]["value"] == "rdma"
        assert kv_config(workload(docs, role))["kv_connector_extra_config"]["protocol"] == "rdma"


@pytest.mark.parametrize("name", ["gpu-tcp", "cpu"])
def test_no_resource_or_the_cpu_stack_is_tcp(rendered: Rendered, name: str) -> None:
    docs = rendered(name)
    for role in ROLES:
        c = _vllm(docs, role)
        assert not [r for r in c["resources"]["limits"] if r.startswith("rdma/")]
        assert "capabilities" not in c["securityContext"]
        assert env(c)["PD_PROTOCOL"]["value"] == "tcp"
        assert env(c)["PD_RDMA_DEVICE"]["value"] == ""  # gpu-tcp names mlx5_0: unused
        extra = kv_config(workload(docs, role))["kv_connector_extra_config"]
        assert (extra["protocol"], extra["device_name"]) == ("tcp", "")


def test_gpudirect_auto_is_passed_on_and_nothing_decides_for_the_image(
        rendered: Rendered) -> None:
    """The image's entrypoint picks peermem or DMA-BUF and tells Mooncake: the chart only
    says PD_GPUDIRECT (a mode named in the values is passed as it is)."""
    for name, mode in (("defaults", "auto"), ("multus", "dmabuf")):
        for role in ROLES:
            names = env(_vllm(rendered(name), role))
            assert names["PD_GPUDIRECT"]["value"] == mode
            assert "WITH_NVIDIA_PEERMEM" not in names


def test_each_role_its_nics(rendered: Rendered) -> None:
    """Per role its own list, comma-joined (Mooncake takes the nearest per GPU), else
    transfer.device for both roles as before, else empty (every NIC Mooncake finds)."""
    cases = [("multus", {"prefill": "mlx5_0,mlx5_1", "decode": "mlx5_2"}),
             ("gpu-tp2-rdma", {"prefill": "mlx5_0", "decode": "mlx5_0"}),
             ("defaults", {"prefill": "", "decode": ""})]
    one_role = _render(rendered, {"transfer": {"decodeDevices": ["mlx5_3"],
                                               "device": "mlx5_0,mlx5_1"}})
    for docs, want in [(rendered(n), w) for n, w in cases] + [
            (one_role, {"prefill": "mlx5_0,mlx5_1", "decode": "mlx5_3"})]:
        for role in ROLES:
            extra = kv_config(workload(docs, role))["kv_connector_extra_config"]
            assert extra["device_name"] == want[role]
            assert env(_vllm(docs, role))["PD_RDMA_DEVICE"]["value"] == want[role]


def test_host_network(rendered: Rendered) -> None:
    docs = rendered("host-network")
    for role in ROLES:
        spec = pod(workload(docs, role))
        assert spec["hostNetwork"] is True
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        c = _vllm(docs, role)
        # The pod IP is the node's; the KV on the node's RDMA interface.
        assert env(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["args"][:6] == ["python3", "-m", "appliance.kvhost", "--interface",
                                 "ens1f0np0", "--"]
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
    assert "hostNetwork" not in pod(workload(docs, "proxy"))
    for role in ROLES:
        spec = pod(workload(rendered("defaults"), role))
        assert "hostNetwork" not in spec and "dnsPolicy" not in spec
        assert _vllm(rendered("defaults"), role)["args"][:4] == LAUNCHER


def _started(c: Doc, pod_ip: str, secondary: str) -> list[str]:
    """The container's command once Kubernetes expanded its variables and appliance.kvhost
    found `secondary` on its interface."""
    args = [a.replace("$(POD_IP)", pod_ip).replace("$(POD_NAME)", "pd-x")
            for a in c["args"]]
    assert args[:3] == ["python3", "-m", "appliance.kvhost"] and args[5] == "--"
    return kvhost.with_kv_host(args[6:], secondary)


def _settings(argv: list[str], tmp_path: Any) -> ConnectorSettings:
    cfg = json.loads(flag(argv, "--kv-transfer-config"))
    token = tmp_path / "bootstrap-token"
    token.write_text("t\n")
    cfg["kv_connector_extra_config"]["bootstrap_token_file"] = str(token)
    return ConnectorSettings.from_kv_transfer_config(SimpleNamespace(**cfg))


def test_multus_network_carries_the_kv(rendered: Rendered, tmp_path: Any) -> None:
    """P and D get the network; their side channel and Mooncake advertise net1's address,
    while HTTP, KV events (VLLM_HOST_IP) and P's sidecar stay on the pod IP, where the
    proxy and D find them."""
    docs = rendered("multus")
    for role, pod_ip, net1 in (("prefill", "10.244.1.7", "192.168.50.3"),
                               ("decode", "10.244.2.9", "192.168.50.4")):
        w = workload(docs, role)
        assert w["spec"]["template"]["metadata"]["annotations"][MULTUS] == "rdma-net"
        c = container(w, "vllm")
        assert c["args"][3:5] == ["--interface", "net1"]
        argv = _started(c, pod_ip, net1)
        assert argv[:4] == LAUNCHER and flag(argv, "--host") == pod_ip
        assert env(c)["VLLM_HOST_IP"]["value"] == "$(POD_IP)"
        s = _settings(argv, tmp_path)
        assert s.resolved_host() == net1
        if role == "prefill":
            boot = container(w, "bootstrap")["args"]
            assert flag(boot, "--host") == "$(POD_IP)"
            assert s.bootstrap_addr == f"http://{pod_ip}:{flag(boot, '--port')}"
        for kind in ("requests", "limits"):
            assert c["resources"][kind]["nvidia.com/sriov_rdma"] == "2"
    assert MULTUS not in (workload(docs, "proxy")["spec"]["template"]["metadata"]
                          .get("annotations", {}))
    assert MULTUS not in workload(rendered("defaults"), "prefill")["spec"]["template"][
        "metadata"]["annotations"]


def test_multus_on_an_ipv6_pod_network_keeps_the_sidecar_url(rendered: Rendered,
                                                             tmp_path: Any) -> None:
    docs = _render(rendered, {"network": {"multus": "rdma-net", "kvInterface": "roce0"},
                              "podNetworkCidrs": ["fd00:10:244::/56"]})
    c = _vllm(docs, "prefill")
    assert c["args"][3:5] == ["--interface", "roce0"]
    s = _settings(_started(c, "fd00:10:244::5", "fd00:99::5"), tmp_path)
    assert s.resolved_host() == "fd00:99::5"
    assert s.bootstrap_addr == "http://[fd00:10:244::5]:8998"
