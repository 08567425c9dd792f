"""The mock API server keeps and refuses what kube-apiserver does for the status subresource and for
fieldValidation (kmock_subresources.py). Each verdict below was seen on kube-apiserver v1.36.2
(/work/kube-build, issue 44 item 4; docs/operator.md "What the mock API server reproduces")."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from op_cluster import BASE_RESOURCES, PATHS, MockCluster

MODEL: dict[str, Any] = {
    "apiVersion": "kubeinfer.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "m"},
    "spec": {"model": {"uri": "hf://org/m"}},
}
DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "d"},
    "spec": {
        "selector": {"matchLabels": {"app": "d"}},
        "template": {
            "metadata": {"labels": {"app": "d"}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        },
    },
}
SERVICE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "s"},
    "spec": {"selector": {"app": "d"}, "ports": [{"port": 80}]},
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster(resources=dict(BASE_RESOURCES)).start()
    yield mock
    mock.stop()


def _named(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return {**copy.deepcopy(obj), "metadata": {"name": name}}


def test_a_create_drops_status(cluster: MockCluster) -> None:
    # v1.36.2: the InferenceModel's status was absent; the Deployment's {}; the Service's loadBalancer {}.
    model = cluster.create("InferenceModel", {**_named(MODEL, "created"), "status": {"phase": "Ready"}})
    assert "status" not in model
    assert "status" not in (cluster.get("InferenceModel", "created") or {})
    deployment = cluster.create("Deployment", {**_named(DEPLOYMENT, "created"), "status": {"replicas": 5}})
    assert deployment["status"] == {}
    service = {**_named(SERVICE, "created"), "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}}
    assert cluster.create("Service", service)["status"] == {"loadBalancer": {}}


def test_a_status_write_changes_status_only(cluster: MockCluster) -> None:
    cluster.create("InferenceModel", _named(MODEL, "status-only"))
    patch = {
        "spec": {"model": {"uri": "hf://org/changed"}},
        "metadata": {"labels": {"x": "y"}},
        "status": {"phase": "Pending"},
    }
    patched = cluster.patch("InferenceModel", "status-only", patch, subresource="status")
    assert patched["spec"]["model"] == {"uri": "hf://org/m"}
    assert "labels" not in patched["metadata"]
    assert patched["status"] == {"phase": "Pending"}
    live = cluster.get("InferenceModel", "status-only")
    assert live is not None
    live["spec"]["model"] = {"uri": "hf://org/changed-by-put"}
    live["status"] = {"phase": "Failed"}
    path = PATHS["InferenceModel"].format(ns="default") + "/status-only/status"
    code, _, replaced = cluster.answer("PUT", path, live)
    assert code == 200
    assert replaced["spec"]["model"] == {"uri": "hf://org/m"}
    assert replaced["status"] == {"phase": "Failed"}
    cluster.create("Deployment", _named(DEPLOYMENT, "status-only"))
    deployment = cluster.patch(
        "Deployment",
        "status-only",
        {"spec": {"replicas": 4}, "status": {"observedGeneration": 1}},
        subresource="status",
    )
    assert deployment["spec"]["replicas"] == 1
    assert deployment["status"]["observedGeneration"] == 1


def test_field_validation_on_a_custom_resource(cluster: MockCluster) -> None:
    base = PATHS["InferenceModel"].format(ns="default")
    unknown = {**_named(MODEL, "fv-strict"), "bogusTop": 2}
    unknown["spec"]["bogus"] = 1
    code, _, refused = cluster.answer("POST", base + "?fieldValidation=Strict", unknown)
    assert code == 400
    assert refused["reason"] == "BadRequest"
    assert refused["message"].startswith(
        'InferenceModel in version "v1alpha1" cannot be handled as a InferenceModel: strict decoding error: '
    )
    assert 'unknown field "bogusTop"' in refused["message"]
    assert 'unknown field "spec.bogus"' in refused["message"]
    assert cluster.get("InferenceModel", "fv-strict") is None

    for mode, warned in (("Warn", True), ("", True), ("Ignore", False)):
        name = f"fv-{mode.lower() or 'default'}"
        body = {**copy.deepcopy(unknown), "metadata": {"name": name}}
        query = f"?fieldValidation={mode}" if mode else ""
        code, warnings, created = cluster.answer("POST", base + query, body)
        assert code in (200, 201)  # kmock answers a create 200; the API server 201
        assert "bogusTop" not in created and "bogus" not in created["spec"]
        expected = ['299 - "unknown field \\"bogusTop\\""', '299 - "unknown field \\"spec.bogus\\""']
        assert sorted(warnings) == (expected if warned else [])
        code, warnings, patched = cluster.answer(
            "PATCH",
            f"{base}/{name}{query}",
            {"spec": {"bogus2": 1}},
            content_type="application/merge-patch+json",
        )
        assert code == 200 and "bogus2" not in patched["spec"]
        assert warnings == (['299 - "unknown field \\"spec.bogus2\\""'] if warned else [])

    code, _, refused = cluster.answer(
        "PATCH",
        f"{base}/fv-warn/status?fieldValidation=Strict",
        {"status": {"bogus3": 1}},
        content_type="application/merge-patch+json",
    )
    assert code == 422
    assert refused["reason"] == "Invalid"
    assert 'strict decoding error: unknown field "status.bogus3"' in refused["message"]
