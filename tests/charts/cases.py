"""The values cases the chart is rendered with, and what each must show."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tests.charts.helmtool import Helm, Result

# Distinctive so a leak into any argument, env value or object is found by a plain search.
KEYS = {"apiKey": "apikey-5f0c1e9a7b3d", "bootstrapToken": "boottoken-8c2e4a6f1d09",
        "sideChannelKey": "curvesecret-0123456789abcdefABCDEF.:+=^!"}
LONG_RELEASE = "a-very-long-release-name-for-the-pd-appliance-x12345"  # 53: helm's limit
# What every install must say (the chart refuses to render without a pod network).
NEEDED: dict[str, Any] = {"podNetworkCidrs": ["10.244.0.0/16"]}


@dataclass(frozen=True)
class Case:
    values: dict[str, Any]
    release: str = "pd"
    # What the rendered objects must show.
    tp: tuple[int, int] = (1, 1)  # P's and D's
    replicas: tuple[int, int] = (1, 1)
    extra: dict[str, Any] = field(default_factory=dict)


# Every pass-through and optional value set at once (all of it must still validate).
EVERY_OPTION: dict[str, Any] = {
    "fullnameOverride": "llm",
    "images": {"pullSecrets": [{"name": "regcred"}], "pullPolicy": "Always",
               "vllm": {"repository": "registry.local:5000/pd/vllm", "tag": "1.2"}},
    "model": {"servedName": "qwen", "blockSize": 64, "maxModelLen": 8192,
              "extraArgs": ["--enforce-eager"], "prefillExtraArgs": ["--max-num-seqs", "8"],
              "decodeExtraArgs": ["--max-num-seqs=64"], "decodePrefillChunk": 256,
              "maxNumBatchedTokens": 1024,
              "volume": {"type": "hostPath", "hostPath": "/data/models", "subPath": "qwen"}},
    "prefill": {
        "extraEnv": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
        "priorityClassName": "inference", "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "pool", "operator": "In", "values": ["prefill"]}]}]}}},
        "topologySpread": {"enabled": True, "maxSkew": 2,
                           "whenUnsatisfiable": "DoNotSchedule"},
        "pdb": {"enabled": True, "maxUnavailable": "50%"},
        "resources": {"requests": {"memory": "64Gi"}, "limits": {"memory": "128Gi"}},
        "shmSize": "32Gi"},
    "decode": {"topologySpread": {"enabled": False}},
    "proxy": {"service": {"type": "NodePort", "nodePort": 30800,
                          "annotations": {"team": "serving"}},
              "extraArgs": ["--log-level", "debug"], "podAnnotations": {"team": "serving"},
              "tokenizer": True,
              "settings": {"max_in_flight_per_decode": 64, "max_queued": 128,
                           "api_keys": [], "kubernetes": {"retry_max_s": 10.0}}},
    "transfer": {"internalNetworks": ["192.168.0.0/16"]},
    "networkPolicy": {"ingressFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]},
}

_CASES: dict[str, Case] = {
    "defaults": Case({}),
    "gpu-tp2-rdma": Case({"model": {"tpSize": 2},
                          "transfer": {"protocol": "rdma", "device": "mlx5_0"},
                          "podNetworkCidrs": ["10.244.0.0/16", "fd00:10:244::/56"]},
                         tp=(2, 2)),
    "cpu": Case({"stack": "cpu", "prefill": {"cpus": 2}, "decode": {"cpus": 3},
                 "model": {"kvCacheBytes": 1 << 30, "maxModelLen": 4096}}),
    "cpu-burstable": Case({"stack": "cpu", "prefill": {"cpus": 2, "cpuRequest": "500m"},
                           "decode": {"cpus": 1, "cpuRequest": "0.25"},
                           "model": {"kvCacheBytes": 1 << 30, "maxModelLen": 4096}}),
    "existing-secret": Case({"keys": {"existingSecret": "my-cluster-keys"}}),
    "inline-keys": Case({"keys": {"existingSecret": "", **KEYS}}),
    "loadbalancer": Case({"proxy": {"service": {"type": "LoadBalancer", "nodePort": 30080,
                                                "loadBalancerSourceRanges": ["10.0.0.0/8"]}}}),
    "3p2d": Case({"prefill": {"replicas": 3}, "decode": {"replicas": 2},
                  "model": {"prefillTpSize": 2, "decodeTpSize": 4},
                  "proxy": {"policy": "least_outstanding", "split": "never",
                            "itlSloMs": 40},
                  "ports": {"prefill": 9010, "decode": 9020, "bootstrap": 9998}},
                 tp=(2, 4), replicas=(3, 2)),
    "long-release": Case({}, release=LONG_RELEASE),
    "every-option": Case(EVERY_OPTION, tp=(1, 1)),
    "no-surge": Case({"prefill": {"replicas": 2, "strategy": {"maxSurge": 0,
                                                               "maxUnavailable": 1}},
                      "decode": {"replicas": 2, "terminationGracePeriodSeconds": 600,
                                 "preStopSleepS": 20,
                                 "strategy": {"maxSurge": 0, "maxUnavailable": "50%"}},
                      "proxy": {"preStopSleepS": 3, "drainGraceS": 60}},
                     replicas=(2, 2)),
    "any-bootstrap": Case({"podNetworkCidrs": [], "allowAnyBootstrap": True}),
    # One setting drives every wait; then an explicit default for D's other callers.
    "short-prefill-wait": Case({"timeouts": {"prefillS": 30, "kvTransferS": 7.5}}),
    "tracing": Case({"tracing": {"otlpEndpoint": "http://otel-collector:4317",
                                 "sampleRatio": 0.1}}),
    "explicit-kv-waits": Case({"timeouts": {"prefillS": 30, "kvRecvS": 45, "kvSendS": 90}}),
    # No RDMA resource named: auto is tcp on the gpu stack too (the device then unused).
    "gpu-tcp": Case({"transfer": {"rdmaResource": {"name": ""}, "device": "mlx5_0"}}),
    # The standalone shared-device plugin's resource; KV on the node's RDMA interface.
    "host-network": Case({"network": {"hostNetwork": True, "kvInterface": "ens1f0np0"},
                          "transfer": {"rdmaResource": {"name": "rdma/hca_shared_devices_a"}},
                          "podNetworkCidrs": ["10.244.0.0/16", "192.168.10.0/24"]}),
    # SR-IOV VFs on a Multus network, NICs per role, a GPUDirect mode named.
    "multus": Case({"network": {"multus": "rdma-net"},
                    "transfer": {"prefillDevices": ["mlx5_0", "mlx5_1"],
                                 "decodeDevices": ["mlx5_2"], "device": "mlx5_4",
                                 "gpudirect": "dmabuf",
                                 "rdmaResource": {"name": "nvidia.com/sriov_rdma", "count": 2}}}),
}


def protocol(v: dict[str, Any]) -> str:
    """The KV protocol effective values give (auto: rdma on gpu with an RDMA resource)."""
    t = v["transfer"]
    if t["protocol"] != "auto":
        return str(t["protocol"])
    return "rdma" if v["stack"] == "gpu" and t["rdmaResource"]["name"] else "tcp"


def rdma_devices(v: dict[str, Any], role: str) -> str:
    """A role's RDMA devices as the connector and the preflight get them ("" over tcp)."""
    t = v["transfer"]
    if protocol(v) != "rdma":
        return ""
    return ",".join(t.get(f"{role}Devices") or []) or str(t["device"])


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, maps merged key by key (as helm merges values files)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


CASES: dict[str, Case] = {name: replace(c, values=merged(NEEDED, c.values))
                          for name, c in _CASES.items()}


class Rendered:
    def __init__(self, helm: Helm) -> None:
        self.helm = helm
        self._cache: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, name: str) -> list[dict[str, Any]]:
        if name not in self._cache:
            case = CASES[name]
            result = self.helm.template(case.values, release=case.release)
            assert result.rc == 0, result.out
            self._cache[name] = result.docs()
        return self._cache[name]

    def values(self, values: dict[str, Any], release: str = "pd") -> Result:
        return self.helm.template(values, release=release)
