"""The API server as build-control-plane.sh builds it encodes maps into JSON: with the
reflect2 1.0.1 the Kubernetes v1.20.2 tree vendors, Go 1.19 builds an API server that
crashes (reflect2.(*UnsafeMapType).UnsafeIterate) on the first custom resource written or
read as JSON."""

from __future__ import annotations

import time
import urllib.error

import pytest

from tests.k8s.controlplane import ControlPlaneUnavailable, control_plane

pytestmark = pytest.mark.slow


def test_a_custom_resource_with_nested_maps_round_trips_as_json(tmp_path):
    try:
        with control_plane(tmp_path / "cp") as cp:
            cp.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", {
                "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": "things.example.com"},
                "spec": {"group": "example.com", "scope": "Namespaced",
                         "names": {"plural": "things", "kind": "Thing", "singular": "thing"},
                         "versions": [{"name": "v1", "served": True, "storage": True,
                                       "schema": {"openAPIV3Schema": {
                                           "type": "object",
                                           "x-kubernetes-preserve-unknown-fields": True}}}]}})
            body = {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
                    "spec": {"nested": {"a": {"b": 1}, "c": ["d"]}}}
            path = "/apis/example.com/v1/namespaces/default/things"
            deadline = time.monotonic() + 30
            while True:  # the CRD's endpoint appears once it is established
                try:
                    cp.request("POST", path, body)
                    break
                except urllib.error.HTTPError as exc:
                    if exc.code != 404 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            assert cp.request("GET", f"{path}/t")["spec"] == body["spec"]
            cp.alive()
    except ControlPlaneUnavailable as exc:
        pytest.skip(str(exc))
