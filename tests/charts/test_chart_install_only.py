"""What only `helm install` renders (NOTES.txt) and what depends on the cluster's version
(PodDisruptionBudget's API), checked offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.charts.cases import KEYS, NEEDED
from tests.charts.helmtool import CHART, Helm
from tests.charts.objects import of_kind


def _notes(helm: Helm, tmp_path: Path, values: dict[str, object]) -> str:
    """NOTES.txt rendered as `helm install` would: a copy of the chart with the notes
    turned into a template (helm template leaves NOTES.txt out)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes-check.yaml").write_text(
        'notes: |\n{{ tpl (.Files.Get "notes.txt") . | indent 2 }}\n')
    result = helm.template(values, "pd", chart, "--show-only", "templates/notes-check.yaml")
    assert result.rc == 0, result.out
    (doc,) = result.docs()
    return str(doc["notes"])


def test_notes_defaults(helm: Helm, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path, NEEDED)
    assert "svc/pd-pd-appliance-proxy 8000" in notes
    assert "create secret generic pd-appliance-keys --from-file=keys/" in notes
    assert "WARNING" not in notes


def test_notes_warn_of_any_bootstrap_and_unreplaced_roles(helm: Helm, tmp_path: Path) -> None:
    no_surge = {"replicas": 1, "strategy": {"maxSurge": 0, "maxUnavailable": 1}}
    notes = _notes(helm, tmp_path, {"allowAnyBootstrap": True, "decode": no_surge})
    assert "podNetworkCidrs is empty (allowAnyBootstrap)" in notes
    assert "decode: one replica and maxSurge 0: every rollout stops decode" in notes
    assert "prefill: one replica" not in notes


def test_notes_inline_keys_and_no_network_policy(helm: Helm, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path, {"keys": {"existingSecret": "", **KEYS},
                                    "podNetworkCidrs": ["10.244.0.0/16"],
                                    "networkPolicy": {"enabled": False}})
    assert "create secret" not in notes and "podNetworkCidrs" not in notes
    assert "17000-17199" in notes
    for value in KEYS.values():
        assert value not in notes


def test_notes_name_the_rdma_resource_and_the_network(helm: Helm, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path, NEEDED)
    assert "P and D pods request rdma/rdma_shared_device_a" in notes
    assert "rdma/hca_shared_devices_a" in notes and "transfer.protocol=tcp" in notes
    host = _notes(helm, tmp_path / "host", {**NEEDED, "network": {"hostNetwork": True}})
    assert "WARNING: network.hostNetwork" in host and "17000-17199" in host
    multus = _notes(helm, tmp_path / "multus", {**NEEDED, "network": {"multus": "rdma-net"}})
    assert "Multus network rdma-net: P and D advertise net1's address" in multus
    tcp = _notes(helm, tmp_path / "tcp", {**NEEDED, "transfer": {"protocol": "tcp"}})
    assert "RDMA" not in tcp and "Multus" not in tcp and "hostNetwork" not in tcp


@pytest.mark.parametrize(("kube", "api"), [("1.20.2", "policy/v1beta1"),
                                           ("1.21.0", "policy/v1"), ("1.33.0", "policy/v1")])
def test_pdb_api_follows_the_cluster(helm: Helm, kube: str, api: str) -> None:
    result = helm.template(NEEDED, "pd", CHART, "--kube-version", kube)
    assert result.rc == 0, result.out
    pdbs = of_kind(result.docs(), "PodDisruptionBudget")
    assert [p["apiVersion"] for p in pdbs] == [api] * 3
