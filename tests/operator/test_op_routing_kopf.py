"""spec.routing under kopf's KopfRunner against kmock: the router's objects are applied next to the
model's, owned by the InferenceModel; kv_aware turns on the servers' KV events; the model's own status
still follows the model's Deployment (not the router's)."""

from __future__ import annotations

import functools
from typing import Any

from op_cluster import MockCluster, wait_for
from op_testlib import inference_model
from test_op_kopf import NAME, mark_deployment_ready, owned_by

ROUTER = f"{NAME}-router"
KINDS = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Service",
    "PodDisruptionBudget",
    "Deployment",
    "ServiceMonitor",
)


def test_routing_applies_the_router_and_keeps_status_on_the_model(
    cluster: MockCluster, operator: Any
) -> None:
    spec = {
        "model": {"uri": "hf://org/model"},
        "routing": {"enabled": True, "policy": "kv_aware", "replicas": 2},
    }
    im = cluster.create("InferenceModel", inference_model(spec, name=NAME))
    for kind in KINDS:
        obj = wait_for(functools.partial(cluster.get, kind, ROUTER), what=f"router {kind}")
        assert owned_by(obj, im), kind
    router = cluster.get("Deployment", ROUTER)
    assert router is not None
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "kv_aware"
    model = wait_for(functools.partial(cluster.get, "Deployment", NAME), what="model Deployment")
    assert "--kv-events-config" in model["spec"]["template"]["spec"]["containers"][0]["args"]
    assert cluster.get("Service", NAME) is not None  # the per-replica Service stays
    mark_deployment_ready(cluster)
    status = wait_for(
        lambda: (
            (s := (cluster.get("InferenceModel", NAME) or {}).get("status"))
            and s.get("phase") == "Ready"
            and s
        ),
        what="Ready status",
    )
    assert status["readyReplicas"] == 1


def test_routing_off_deletes_only_the_router_objects_it_owns(cluster: MockCluster, operator: Any) -> None:
    spec: dict[str, Any] = {
        "model": {"uri": "hf://org/model"},
        "routing": {"enabled": True, "policy": "kv_aware", "replicas": 2},
    }
    im = cluster.create("InferenceModel", inference_model(spec, name=NAME))
    for kind in KINDS:
        wait_for(functools.partial(cluster.get, kind, ROUTER), what=f"router {kind}")
    own = {kind: cluster.get(kind, NAME) for kind in ("Deployment", "Service", "ServiceMonitor")}
    assert all(obj is not None and owned_by(obj, im) for obj in own.values())

    cluster.patch("InferenceModel", NAME, {"spec": {"routing": {"enabled": False}}})
    wait_for(lambda: all(cluster.get(kind, ROUTER) is None for kind in KINDS), what="router objects deleted")
    # The model's own children stay (same objects, not recreated); its servers stop publishing KV events.
    model = wait_for(
        lambda: (
            (d := cluster.get("Deployment", NAME))
            and "--kv-events-config" not in d["spec"]["template"]["spec"]["containers"][0]["args"]
            and d
        ),
        what="model Deployment without KV events",
    )
    for kind, before in own.items():
        live = model if kind == "Deployment" else cluster.get(kind, NAME)
        assert live is not None and owned_by(live, im), kind
        assert live["metadata"]["uid"] == before["metadata"]["uid"], kind  # type: ignore[index]

    # Someone else's object under the router's name is never deleted, whatever the model's spec says.
    foreign = cluster.create("ServiceAccount", {"metadata": {"name": ROUTER}})
    patched = cluster.patch("InferenceModel", NAME, {"spec": {"routing": {"replicas": 1}}})
    generation = patched["metadata"]["generation"]
    wait_for(
        lambda: (
            ((cluster.get("InferenceModel", NAME) or {}).get("status") or {}).get("observedGeneration")
            == generation
        ),
        what="a reconcile after the foreign ServiceAccount appeared",
    )
    live_sa = cluster.get("ServiceAccount", ROUTER)
    assert live_sa is not None and live_sa["metadata"]["uid"] == foreign["metadata"]["uid"]
