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
