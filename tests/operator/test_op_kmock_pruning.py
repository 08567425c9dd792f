"""The mock API server prunes what a custom resource's schema does not declare, as kube-apiserver does
(kmock_pruning.py): on the main resource and on /status, for create, merge patch, apply and replace.

The verdicts below were seen on kube-apiserver v1.36.2 (/work/kube-build, issue 44 item 4): a toy CRD
with a status subresource, and our InferenceModel CRD, written with the python client (fieldValidation
unset, so Warn: pruned with a warning header, never refused)."""

from __future__ import annotations

import copy
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest
from kmock_pruning import prune, prune_resource
from op_cluster import BASE_RESOURCES, MockCluster

# The toy CRD's openAPIV3Schema as created on the real API server.
TOY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "a": {"type": "string"},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "items": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
                "m": {
                    "type": "object",
                    "additionalProperties": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
            },
        },
        "status": {
            "type": "object",
            "properties": {
                "phase": {"type": "string"},
                "free": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"typed": {"type": "object", "properties": {"k": {"type": "string"}}}},
                },
                "any": {"x-kubernetes-preserve-unknown-fields": True},
                "items": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
                "m": {
                    "type": "object",
                    "additionalProperties": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
                "anyMap": {"type": "object", "additionalProperties": True},
            },
        },
    },
}


def test_pruning_gives_what_the_real_api_server_stored() -> None:
    # POST of a Toy: unknown spec.b, list item and map value fields, and a root field are dropped;
    # spec.free keeps everything under it. (status on a create is dropped whole: the status subresource.)
    created = {
        "apiVersion": "example.dev/v1",
        "kind": "Toy",
        "metadata": {"name": "t"},
        "spec": {
            "a": "x",
            "b": 1,
            "free": {"u": {"v": 1}},
            "items": [{"k": "1", "x": 2}],
            "m": {"one": {"k": "1", "x": 2}},
        },
        "junk": 1,
    }
    prune_resource(created, TOY)
    assert created == {
        "apiVersion": "example.dev/v1",
        "kind": "Toy",
        "metadata": {"name": "t"},
        "spec": {"a": "x", "free": {"u": {"v": 1}}, "items": [{"k": "1"}], "m": {"one": {"k": "1"}}},
    }
    # A merge patch of /status: seen in the response and in a later GET.
    status: dict[str, Any] = {
        "phase": "Q",
        "bogus": 1,
        "free": {"u": 1, "typed": {"k": "1", "x": 2}},
        "any": {"z": [1, {"y": 2}]},
        "items": [{"k": "1", "x": 2}],
        "m": {"one": {"k": "1", "x": 2}},
        "anyMap": {"a": {"b": 1}},
    }
    prune(status, TOY["properties"]["status"])
    assert status == {
        "any": {"z": [1, {"y": 2}]},  # preserved, lists and all
        "anyMap": {"a": {}},  # additionalProperties: true keeps the key, prunes inside it
        "free": {"typed": {"k": "1"}, "u": 1},  # a declared field under preserve is pruned by its own schema
        "items": [{"k": "1"}],
        "m": {"one": {"k": "1"}},
        "phase": "Q",
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster(resources=dict(BASE_RESOURCES)).start()
    yield mock
    mock.stop()


MODEL: dict[str, Any] = {
    "apiVersion": "kubeinfer.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "prune"},
    "spec": {
        "model": {"uri": "hf://org/m"},
        "bogusSpec": 1,
        "scheduling": {"affinity": {"nodeAffinity": {"anything": {"kept": True}}}},
    },
    "bogusRoot": 1,
}
CONDITION = {
    "type": "Ready",
    "status": "True",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
    "reason": "R",
    "message": "m",
}


def test_the_mock_prunes_status_writes_as_the_api_server_does(cluster: MockCluster) -> None:
    cluster.create("InferenceModel", {**copy.deepcopy(MODEL), "metadata": {"name": "status-prune"}})
    # Seen on v1.36.2 for this very merge patch of our CRD's /status: the response and a later GET hold
    # `seen`.
    status = {
        "phase": "Ready",
        "bogusTop": 1,
        "observedGeneration": 1,
        "conditions": [{**CONDITION, "bogusInCondition": "x"}],
        "cache": {"phase": "Ready", "claimName": "c", "bogusNested": 2},
    }
    seen = {
        "cache": {"claimName": "c", "phase": "Ready"},
        "conditions": [CONDITION],
        "observedGeneration": 1,
        "phase": "Ready",
    }
    answer = cluster.patch("InferenceModel", "status-prune", {"status": status}, subresource="status")
    assert answer["status"] == seen
    live = cluster.get("InferenceModel", "status-prune")
    assert live is not None and live["status"] == seen


def test_the_mock_prunes_the_main_resource_as_the_api_server_does(cluster: MockCluster) -> None:
    created = cluster.create("InferenceModel", copy.deepcopy(MODEL))
    assert "bogusRoot" not in created and "bogusSpec" not in created["spec"]
    # scheduling.affinity is x-kubernetes-preserve-unknown-fields (a core/v1 Affinity)
    assert created["spec"]["scheduling"]["affinity"] == {"nodeAffinity": {"anything": {"kept": True}}}
    # An unknown spec field in a merge patch and in a replace (PUT) is dropped.
    patched = cluster.patch("InferenceModel", "prune", {"spec": {"bogusSpec": 2, "suspend": True}})
    assert "bogusSpec" not in patched["spec"] and patched["spec"]["suspend"] is True
    live = cluster.get("InferenceModel", "prune")
    assert live is not None and "bogusSpec" not in live["spec"]
    live["spec"]["bogusPut"] = 1
    replaced = cluster.replace("InferenceModel", live)
    assert "bogusPut" not in replaced["spec"] and replaced["spec"]["model"] == {"uri": "hf://org/m"}


@pytest.mark.parametrize(
    ("name", "body", "subresource", "field"),
    [
        (
            "prune-apply",
            {"spec": {"model": {"uri": "hf://org/m"}, "bogusApplied": 1}},
            "",
            ".spec.bogusApplied",
        ),
        ("prune-apply", {"spec": {"model": {"uri": "hf://org/m"}}, "bogusRoot": 1}, "", ".bogusRoot"),
        (
            "prune-apply",
            {"status": {"phase": "Ready", "bogusSsaStatus": 1}},
            "/status",
            ".status.bogusSsaStatus",
        ),
    ],
)
def test_an_apply_of_an_undeclared_field_is_refused_as_the_api_server_refuses_it(
    cluster: MockCluster, name: str, body: dict[str, Any], subresource: str, field: str
) -> None:
    # Seen on v1.36.2 for each of these server-side applies (a missing object's too): 500
    # `failed to create typed patch object (/prune; kubeinfer.dev/v1alpha1, Kind=InferenceModel):
    # .spec.bogusApplied: field not declared in schema`, and nothing written.
    if cluster.get("InferenceModel", name) is None:
        cluster.create("InferenceModel", {**copy.deepcopy(MODEL), "metadata": {"name": name}})
    before = cluster.get("InferenceModel", name)
    doc = {"apiVersion": MODEL["apiVersion"], "kind": "InferenceModel", "metadata": {"name": name}, **body}
    path = f"/apis/kubeinfer.dev/v1alpha1/namespaces/default/inferencemodels/{name}{subresource}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        cluster.request(
            "PATCH", path + "?fieldManager=tester&force=true", doc, "application/apply-patch+yaml"
        )
    assert refused.value.code == 500
    message = refused.value.read().decode()
    assert (
        f"failed to create typed patch object (/{name}; kubeinfer.dev/v1alpha1, Kind=InferenceModel): "
        f"{field}: field not declared in schema"
    ) in message
    assert cluster.get("InferenceModel", name) == before
