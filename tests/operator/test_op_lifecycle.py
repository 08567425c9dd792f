"""Issue 29, item 5: a namespace being deleted is left alone, and a missing autoscaler API leaves the
model serving at its floor. The operator under kopf against kmock, which refuses creates in a
terminating namespace as the real API server's NamespaceLifecycle admission does (kmock_lifecycle.py)."""

from __future__ import annotations

import functools
import time
from typing import Any

from op_cluster import KEDA, MockCluster, condition, run_operator, wait_for, wait_quiet
from op_testlib import inference_model

NAME = "llm"
HF = {"uri": "hf://org/model"}
# Long enough for several resyncs (2 s in these tests) and a re-listing (kopf's watches end every 5 s).
QUIET_SECONDS = 6.0


def _ready(cluster: MockCluster) -> None:
    dep = cluster.get("Deployment", NAME)
    assert dep is not None
    cluster.patch(
        "Deployment",
        NAME,
        {
            "status": {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": 1,
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "availableReplicas": 1,
            }
        },
        subresource="status",
    )


def _serving_model(cluster: MockCluster) -> None:
    cluster.create("InferenceModel", inference_model({"model": HF}, name=NAME))
    for kind in ("Deployment", "Service"):
        wait_for(functools.partial(cluster.get, kind, NAME), what=kind)
    _ready(cluster)
    wait_for(lambda: _status(cluster).get("phase") == "Ready", what="phase Ready")
    # kopf posts Events asynchronously (and retries them): the one announcing Ready is out first.
    wait_for(
        lambda: any(e.get("reason") == "ReplicasReady" for e in cluster.live("Event")), what="Ready Event"
    )


def _status(cluster: MockCluster) -> dict[str, Any]:
    return dict((cluster.get("InferenceModel", NAME) or {}).get("status") or {})


def _terminate_namespace(cluster: MockCluster) -> None:
    cluster.server.namespace_store.terminate("default")


def _namespace_controller_deletes_children(cluster: MockCluster) -> None:
    for kind in ("Deployment", "Service", "ServiceMonitor"):
        cluster.delete(kind, NAME)
    # With the Deployment its pods go: a model that was serving has no ready replica left, which
    # would otherwise be reported as Degraded NoReadyReplicas with a Warning event.


def _assert_left_alone(cluster: MockCluster, events: int, status_writes: int) -> None:
    time.sleep(QUIET_SECONDS)
    assert cluster.get("Deployment", NAME) is None and cluster.get("Service", NAME) is None
    degraded = condition(cluster.get("InferenceModel", NAME), "Degraded") or {}
    assert degraded.get("status") != "True", degraded
    assert cluster.count_requests("POST", "events") == events, "no Event posted into a dying namespace"
    assert _status_writes(cluster) == status_writes, "no status written"


def _status_writes(cluster: MockCluster) -> int:
    return sum(
        1
        for r in list(cluster.server)
        if r.resource is not None and r.resource.plural == "inferencemodels" and r.subresource == "status"
    )


def test_terminating_namespace_is_left_alone(cluster: MockCluster, operator: Any) -> None:
    _serving_model(cluster)
    _terminate_namespace(cluster)
    wait_quiet(cluster)  # a reconcile already under way finishes
    applies = cluster.count_requests("PATCH", "deployments") + cluster.count_requests("PATCH", "services")
    events, writes = cluster.count_requests("POST", "events"), _status_writes(cluster)
    _namespace_controller_deletes_children(cluster)
    _assert_left_alone(cluster, events, writes)
    # Not even tried: the operator read the Namespace before applying anything.
    after = cluster.count_requests("PATCH", "deployments") + cluster.count_requests("PATCH", "services")
    assert after == applies


def test_refusal_of_a_terminating_namespace_stops_the_reconcile_quietly(
    cluster: MockCluster, operator: Any
) -> None:
    _serving_model(cluster)
    # The operator cannot read the Namespace (RBAC): it learns from the API server's 403 on a create.
    cluster.server.namespace_store.readable = False
    _terminate_namespace(cluster)
    wait_quiet(cluster)
    events, writes = cluster.count_requests("POST", "events"), _status_writes(cluster)
    _namespace_controller_deletes_children(cluster)
    _assert_left_alone(cluster, events, writes)


def _autoscaled(autoscaler: str, min_replicas: int) -> dict[str, Any]:
    scaling: dict[str, Any] = {"autoscaler": autoscaler, "minReplicas": min_replicas, "maxReplicas": 3}
    if autoscaler == "KEDA":
        scaling["prometheusAddress"] = "http://prometheus:9090"
    return {"model": HF, "scaling": scaling}


def test_keda_without_its_crd_serves_at_the_floor_and_takes_keda_up_later(cluster_factory: Any) -> None:
    cluster = cluster_factory(keda=False)
    with run_operator():
        cluster.create("InferenceModel", inference_model(_autoscaled("KEDA", 0), name=NAME))
        dep = wait_for(functools.partial(cluster.get, "Deployment", NAME), what="Deployment")
        assert dep["spec"]["replicas"] == 1  # max(minReplicas, 1): the model serves
        assert cluster.get("Service", NAME) is not None
        cond = wait_for(
            lambda: condition(cluster.get("InferenceModel", NAME), "AutoscalingAvailable"), what="condition"
        )
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
        assert "keda.sh/v1alpha1" in cond["message"]
        degraded = condition(cluster.get("InferenceModel", NAME), "Degraded") or {}
        assert degraded.get("status") == "False", degraded

        cluster.add_resources(KEDA)  # KEDA is installed afterwards
        wait_for(functools.partial(cluster.get, "ScaledObject", NAME), timeout=90, what="ScaledObject")
        wait_for(
            lambda: (
                (condition(cluster.get("InferenceModel", NAME), "AutoscalingAvailable") or {}).get("status")
                == "True"
            ),
            timeout=90,
            what="AutoscalingAvailable=True",
        )
        # The count was handed to the autoscaler without dropping the serving replica.
        assert all((v.get("spec") or {}).get("replicas", 1) >= 1 for v in cluster.history("Deployment", NAME))


def test_hpa_api_missing_serves_at_the_floor(cluster_factory: Any) -> None:
    cluster = cluster_factory()
    del cluster.server.resources["autoscaling/v2/horizontalpodautoscalers"]
    with run_operator():
        cluster.create("InferenceModel", inference_model(_autoscaled("HPA", 2), name=NAME))
        dep = wait_for(functools.partial(cluster.get, "Deployment", NAME), what="Deployment")
        assert dep["spec"]["replicas"] == 2
        cond = wait_for(
            lambda: condition(cluster.get("InferenceModel", NAME), "AutoscalingAvailable"), what="condition"
        )
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
        assert cluster.count_requests("PATCH", "horizontalpodautoscalers") == 0
