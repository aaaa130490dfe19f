"""Cluster descriptions as chart values (appliance.pdctl.cluster.helmvalues), and the chart rendered
from them: as many P and D pods as the description has instances, GPUs per pod = TP."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from appliance.pdctl.cluster.description import parse_cluster
from appliance.pdctl.cluster.helmvalues import KEYS_SECRET, helm_values
from appliance.pdctl.errors import ConfigError
from tests.charts import objects
from tests.charts.cases import Rendered
from tests.charts.objects import container, flag, kv_config, of_kind, pod, workload

POD_NETWORK = {"pod_network_cidrs": ["10.244.0.0/16", "fd00:10:244::/56"]}


def _desc(*hosts: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"model": {"path": "/models/qwen", **top.pop("model", {})},
            "proxy": top.pop("proxy", {"host": "a"}), "hosts": list(hosts),
            "transfer": top.pop("transfer", {"protocol": "rdma", "device": "mlx5_0"}),
            "kubernetes": top.pop("kubernetes", POD_NETWORK), **top}


DESCRIPTIONS: dict[str, tuple[dict[str, Any], tuple[int, int], tuple[int, int]]] = {
    # name: (description, (P, D) replicas, (P, D) GPUs per pod)
    "1p1d": (_desc({"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]],
                    "decode": [[1]]}), (1, 1), (1, 1)),
    "2p1d": (_desc({"name": "a", "ip": "10.0.0.1", "gpus": 8, "prefill": [[0], [1]]},
                   {"name": "b", "ip": "10.0.0.2", "gpus": 8, "decode": [[0]]},
                   proxy={"host": "b", "policy": "least_outstanding", "split": "always",
                          "itl_slo_ms": 25}), (2, 1), (1, 1)),
    "1p2d-tp2": (_desc({"name": "a", "ip": "10.0.0.1", "gpus": 8, "prefill": [[0, 1]],
                        "decode": [[2, 3], [4, 5]]}, model={"tp_size": 2}), (1, 2), (2, 2)),
    "p-tp2-d-tp1": (_desc({"name": "a", "ip": "10.0.0.1", "gpus": 8, "prefill": [[0, 1]],
                           "decode": [[2], [3], [4]]},
                          model={"tp_size": 1, "prefill_tp_size": 2}), (1, 3), (2, 1)),
}


@pytest.mark.parametrize("name", DESCRIPTIONS)
def test_values_from_a_description(name: str) -> None:
    data, replicas, tp = DESCRIPTIONS[name]
    desc = parse_cluster(data)
    values = helm_values(desc)
    assert (values["prefill"]["replicas"], values["decode"]["replicas"]) == replicas
    assert (values["model"]["prefillTpSize"], values["model"]["decodeTpSize"]) == tp
    assert values["stack"] == "gpu" and values["model"]["path"] == "/models/qwen"
    assert values["model"]["volume"] == {"type": "hostPath", "hostPath": "/models/qwen"}
    # the proxy's own settings as the description gives them (its [proxy] but the host)
    assert values["proxy"] == {"settings": {k: v for k, v in data["proxy"].items()
                                            if k != "host"}}
    assert values["model"].get("decodePrefillChunk") == desc.model.decode_prefill_chunk
    assert values["model"].get("maxNumBatchedTokens") == desc.model.max_num_batched_tokens
    assert values["transfer"]["protocol"] == "rdma" and values["transfer"]["device"] == "mlx5_0"
    assert values["ports"] == {"prefill": 8010, "decode": 8020, "bootstrap": 8998,
                               "proxy": 8000}
    # no key material: the chart mounts a Secret made from pdctl init's keys/
    assert values["keys"] == {"existingSecret": KEYS_SECRET}
    assert values["podNetworkCidrs"] == POD_NETWORK["pod_network_cidrs"]
    assert yaml.safe_load(yaml.safe_dump(values)) == values  # writes as a values file


@pytest.mark.parametrize("name", DESCRIPTIONS)
def test_chart_from_the_values(rendered: Rendered, name: str) -> None:
    data, replicas, tp = DESCRIPTIONS[name]
    result = rendered.values(helm_values(parse_cluster(data)))
    assert result.rc == 0, result.out
    docs = result.docs()
    extra = kv_config(workload(docs, "decode"))["kv_connector_extra_config"]
    assert extra["allowed_bootstrap_networks"] == POD_NETWORK["pod_network_cidrs"]
    for role, n, gpus in zip(("prefill", "decode"), replicas, tp, strict=True):
        w = workload(docs, role)
        assert w["spec"]["replicas"] == n
        c = container(w, "vllm")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert flag(c["args"], "--tensor-parallel-size") == str(gpus)
        assert "rdma/rdma_shared_device_a" in c["resources"]["limits"]  # Network Operator's
        (model,) = [v for v in pod(w)["volumes"] if v["name"] == "model"]
        assert model["hostPath"]["path"] == "/models/qwen"
    assert of_kind(docs, "Secret") == []
    got = objects.proxy_settings(docs)  # the description's proxy settings reach the proxy's file
    assert {k: got[k] for k in data["proxy"] if k != "host"} == \
        {k: v for k, v in data["proxy"].items() if k != "host"}


def test_each_roles_nics_and_gpudirect(rendered: Rendered) -> None:
    """The description's NICs per role (else `device`) and GPUDirect mode reach each role's
    connector and preflight as TransferSection.device_name gives them."""
    data = _desc({"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]], "decode": [[1]]},
                 transfer={"protocol": "rdma", "device": "mlx5_4",
                           "prefill_devices": ["mlx5_0", "mlx5_1"]})
    desc = parse_cluster(data)
    t = helm_values(desc)["transfer"]
    assert (t["prefillDevices"], t["decodeDevices"], t["device"]) == (
        ["mlx5_0", "mlx5_1"], [], "mlx5_4")
    assert t["gpudirect"] == "auto"
    result = rendered.values(helm_values(desc))
    assert result.rc == 0, result.out
    for role in ("prefill", "decode"):
        w = workload(result.docs(), role)
        want = desc.transfer.device_name(role)
        assert kv_config(w)["kv_connector_extra_config"]["device_name"] == want
        names = {e["name"]: e.get("value") for e in container(w, "vllm")["env"]}
        assert (names["PD_RDMA_DEVICE"], names["PD_GPUDIRECT"]) == (want, "auto")
    assert desc.transfer.device_name("prefill") == "mlx5_0,mlx5_1"


def test_cpu_description() -> None:
    data = _desc({"name": "a", "ip": "10.0.0.1", "cpus": 16, "prefill": [[0, 1, 2, 3]],
                  "decode": [[4, 5], [6, 7, 8]]}, stack="cpu", transfer={})
    values = helm_values(parse_cluster(data))
    assert values["stack"] == "cpu" and values["transfer"]["protocol"] == "tcp"
    assert (values["prefill"]["cpus"], values["decode"]["cpus"]) == (4, 3)
    assert (values["prefill"]["replicas"], values["decode"]["replicas"]) == (1, 2)


def test_cpu_chart_from_the_values(rendered: Rendered) -> None:
    data = _desc({"name": "a", "ip": "10.0.0.1", "cpus": 8, "prefill": [[0, 1]],
                  "decode": [[2, 3, 4]]}, stack="cpu", transfer={})
    result = rendered.values(helm_values(parse_cluster(data)))
    assert result.rc == 0, result.out
    c = container(workload(result.docs(), "decode"), "vllm")
    assert c["resources"]["requests"] == {"cpu": "3"}
    assert "nvidia.com/gpu" not in c["resources"]["limits"]


def test_timeouts_images_and_shm_carry_over(rendered: Rendered) -> None:
    data = _desc({"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]], "decode": [[1]]},
                 timeouts={"startup_s": 1200, "kv_send_s": 90, "kv_recv_s": 45,
                           "bootstrap_ttl_s": 20},
                 images={"vllm": "registry.local:5000/pd/vllm@sha256:" + "a" * 64,
                         "slim": "registry.local:5000/pd/slim:1.2"},
                 compose={"shm_size": "32g"})
    values = helm_values(parse_cluster(data))
    assert values["images"] == {
        "vllm": {"repository": "registry.local:5000/pd/vllm", "tag": "sha256:" + "a" * 64},
        "slim": {"repository": "registry.local:5000/pd/slim", "tag": "1.2"}}
    assert values["prefill"]["shmSize"] == values["decode"]["shmSize"] == "32Gi"
    assert values["bootstrap"] == {"ttlS": 20}
    result = rendered.values(values)
    assert result.rc == 0, result.out
    docs = result.docs()
    p = workload(docs, "prefill")
    assert container(p, "vllm")["image"] == "registry.local:5000/pd/vllm@sha256:" + "a" * 64
    assert container(p, "bootstrap")["image"] == "registry.local:5000/pd/slim:1.2"
    assert flag(container(p, "bootstrap")["args"], "--ttl") == "20"
    probe = container(p, "vllm")["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1200
    extra = json.loads(flag(container(p, "vllm")["args"], "--kv-transfer-config"))
    assert extra["kv_connector_extra_config"]["send_timeout_s"] == 90
    (shm,) = [v for v in pod(p)["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["sizeLimit"] == "32Gi"


def test_a_description_without_pod_network_is_refused() -> None:
    """The chart would refuse the values (D open to any bootstrap address): one line."""
    data = _desc({"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]],
                  "decode": [[1]]}, kubernetes={})
    with pytest.raises(ConfigError) as err:
        helm_values(parse_cluster(data))
    (line,) = err.value.lines
    assert line.startswith("kubernetes.pod_network_cidrs:") and "10.244.0.0/16" in line


def test_bad_pod_networks_one_line_each() -> None:
    data = _desc({"name": "a", "ip": "10.0.0.1", "gpus": 2, "prefill": [[0]],
                  "decode": [[1]]},
                 kubernetes={"pod_network_cidrs": ["10.244.0.0/16", "pods", "10.0.0.0/33"]})
    with pytest.raises(ConfigError) as err:
        parse_cluster(data)
    assert err.value.lines == [
        "kubernetes.pod_network_cidrs.1: 'pods' is not a network (e.g. 10.244.0.0/16)",
        "kubernetes.pod_network_cidrs.2: '10.0.0.0/33' is not a network (e.g. 10.244.0.0/16)"]
