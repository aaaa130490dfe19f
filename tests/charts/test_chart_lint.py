"""helm lint --strict and helm template over the values matrix, and bad values refused with
a message that names the problem."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.cases import CASES, KEYS, NEEDED, Rendered, merged
from tests.charts.helmtool import Helm


@pytest.mark.parametrize("name", CASES)
def test_lint_strict(helm: Helm, name: str) -> None:
    result = helm.lint(CASES[name].values)
    assert result.rc == 0, result.out
    assert "0 chart(s) failed" in result.out


@pytest.mark.parametrize("name", CASES)
def test_template_renders_every_kind(rendered: Rendered, name: str) -> None:
    kinds = sorted({d["kind"] for d in rendered(name)})
    expected = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                "PodDisruptionBudget", "NetworkPolicy"}
    assert expected <= set(kinds)
    assert ("Secret" in kinds) == (name == "inline-keys")


# Per-field problems are the schema's (helm lint finds them too); rules across fields are the
# templates' `fail`, which helm lint deliberately does not run (lint mode logs a fail).
BAD: dict[str, tuple[dict[str, Any], list[str]]] = {
    "unknown key": ({"model": {"tpsize": 2}}, ["tpsize", "not allowed"]),
    "unknown top-level key": ({"replicas": 2}, ["replicas", "not allowed"]),
    "stack tpu": ({"stack": "tpu"}, ["stack", '"gpu", "cpu"']),
    "negative replicas": ({"decode": {"replicas": -1}}, ["decode.replicas", "0"]),
    "tp zero": ({"model": {"tpSize": 0}}, ["model.tpSize"]),
    "policy": ({"proxy": {"policy": "random"}}, ["proxy.policy"]),
    "split": ({"proxy": {"split": "sometimes"}}, ["proxy.split"]),
    "itl budget": ({"proxy": {"itlSloMs": 0}}, ["proxy.itlSloMs"]),
    "service type": ({"proxy": {"service": {"type": "ExternalName"}}},
                     ["proxy.service.type"]),
    "port": ({"ports": {"decode": 70000}}, ["ports.decode"]),
    "derived proxy setting": ({"proxy": {"settings": {"prefill_timeout_s": 9}}},
                              ["proxy.settings.prefill_timeout_s", "the chart sets it",
                               "timeouts"]),
    "derived discovery setting": ({"proxy": {"settings": {"kubernetes": {"decode_port": 9}}}},
                                  ["proxy.settings.kubernetes.decode_port",
                                   "the chart sets it"]),
    "both key sources": ({"keys": KEYS}, ["not both", "keys.existingSecret"]),
    "neither key source": ({"keys": {"existingSecret": ""}},
                           ["no keys", "keys.existingSecret", "kubectl create secret"]),
    "half the keys": ({"keys": {"existingSecret": "", "apiKey": "x"}}, ["go together"]),
    "cpu with rdma": ({"stack": "cpu", "transfer": {"protocol": "rdma"}},
                      ["transfer.protocol", "tcp"]),
    "managed flag": ({"model": {"decodeExtraArgs": ["--port=9"]}},
                     ["model.decodeExtraArgs", "--port"]),
    "pvc without claim": ({"model": {"volume": {"type": "pvc", "claimName": ""}}},
                          ["model.volume.claimName"]),
    "short port range": ({"transfer": {"portRange": [17000, 17010]}},
                         ["transfer.portRange", "32"]),
    "bad cidr": ({"podNetworkCidrs": ["10.244.0.0"]}, ["podNetworkCidrs"]),
    "no pod network": ({"podNetworkCidrs": []},
                       ["podNetworkCidrs: empty", "allowAnyBootstrap=true"]),
    "grace too short": ({"decode": {"terminationGracePeriodSeconds": 30}},
                        ["decode.terminationGracePeriodSeconds", "45"]),
    "preStop too long": ({"prefill": {"preStopSleepS": 31}}, ["prefill.preStopSleepS"]),
    "strategy typo": ({"decode": {"strategy": {"maxSurge": 1, "maxUnavailable": 0,
                                               "maxSurgee": 2}}}, ["maxSurgee"]),
    "strategy both 0": ({"decode": {"strategy": {"maxSurge": 0, "maxUnavailable": "0%"}}},
                        ["decode.strategy", "both 0"]),
    "shutdown flag": ({"model": {"extraArgs": ["--shutdown-timeout", "5"]}},
                      ["--shutdown-timeout", "terminationGracePeriodSeconds"]),
    "step budget flag": ({"model": {"extraArgs": ["--max-num-batched-tokens=512"]}},
                         ["model.extraArgs", "model.maxNumBatchedTokens"]),
    "chunk flag": ({"model": {"decodeExtraArgs": ["--long-prefill-token-threshold", "64"]}},
                   ["model.decodeExtraArgs", "model.decodePrefillChunk"]),
    "cpu step budget": ({"stack": "cpu", "model": {"maxNumBatchedTokens": 64}},
                        ["model.maxNumBatchedTokens: 64", "128"]),
    "cpu request": ({"stack": "cpu", "decode": {"cpuRequest": "half"}},
                    ["decode.cpuRequest"]),
    "rdma without a resource": ({"transfer": {"protocol": "rdma",
                                              "rdmaResource": {"name": "", "count": 1}}},
                                ["transfer.rdmaResource.name", "rdma/rdma_shared_device_a",
                                 "rdma/hca_shared_devices_a"]),
    "host network and multus": ({"network": {"hostNetwork": True, "multus": "rdma-net"}},
                                ["network: hostNetwork and multus exclude each other"]),
    "multus twice": ({"network": {"multus": "rdma-net"},
                      "decode": {"podAnnotations": {"k8s.v1.cni.cncf.io/networks": "b"}}},
                     ["decode.podAnnotations", "set network.multus alone"]),
    "kv interface": ({"network": {"kvInterface": "net1; reboot"}}, ["network.kvInterface"]),
    "nic twice": ({"transfer": {"prefillDevices": ["mlx5_0", "mlx5_0"]}},
                  ["transfer.prefillDevices", "unique"]),
}


ACROSS_FIELDS = {"both key sources", "neither key source", "half the keys", "cpu with rdma",
                 "managed flag", "pvc without claim", "short port range", "no pod network",
                 "strategy both 0", "shutdown flag", "step budget flag", "chunk flag",
                 "cpu step budget", "rdma without a resource", "host network and multus",
                 "multus twice", "derived proxy setting", "derived discovery setting"}


@pytest.mark.parametrize("name", BAD)
def test_bad_values_refused(helm: Helm, name: str) -> None:
    values, words = BAD[name]
    values = merged(NEEDED, values)
    result = helm.template(values)
    assert result.rc != 0, f"rendered despite {name}"
    for word in words:
        assert word in result.out, result.out
    if name not in ACROSS_FIELDS:
        assert helm.lint(values).rc != 0
