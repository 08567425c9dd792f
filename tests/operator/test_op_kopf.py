"""The operator under kopf's KopfRunner against kmock: create, update, drift repair, status
conditions, suspend, delete, monitoring discovery and invalid specs."""

from __future__ import annotations

import functools
from typing import Any

from op_cluster import MockCluster, condition, run_operator, wait_for, wait_quiet
from op_testlib import inference_model

NAME = "llm"


def im_doc(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return inference_model(spec or {"model": {"uri": "hf://org/model"}}, name=NAME)


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == [
        ("InferenceModel", owner["metadata"]["name"], owner["metadata"]["uid"], True)
    ]


def mark_deployment_ready(cluster: MockCluster, replicas: int = 1) -> None:
    """Play the Deployment controller: report the rollout as complete."""
    dep = cluster.get("Deployment", NAME)
    assert dep is not None
    cluster.patch(
        "Deployment",
        NAME,
        {
            "status": {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": replicas,
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
                "availableReplicas": replicas,
                "conditions": [
                    {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                    {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
                ],
            }
        },
        subresource="status",
    )


def test_create_applies_children_and_reports_status(cluster: MockCluster, operator: Any) -> None:
    im = cluster.create("InferenceModel", im_doc())
    for kind in ("Deployment", "Service", "ServiceMonitor"):
        wait_for(functools.partial(cluster.get, kind, NAME), what=kind)
        assert owned_by(cluster.get(kind, NAME), im), kind  # type: ignore[arg-type]
    assert cluster.get("HorizontalPodAutoscaler", NAME) is None
    assert cluster.get("PodDisruptionBudget", NAME) is None

    status = wait_for(lambda: (cluster.get("InferenceModel", NAME) or {}).get("status"), what="status")
    assert status["phase"] == "Pending"
    assert status["endpoint"] == "http://llm.default.svc:8080"
    assert status["selector"] == "app.kubernetes.io/name=kubeinfer-server,app.kubernetes.io/instance=llm"
    assert condition({"status": status}, "MonitoringAvailable")["status"] == "True"  # type: ignore[index]

    mark_deployment_ready(cluster)
    ready = wait_for(
        lambda: (
            (cluster.get("InferenceModel", NAME) or {}).get("status", {}).get("phase") == "Ready"
            and cluster.get("InferenceModel", NAME)
        ),
        what="phase Ready",
    )
    st = ready["status"]
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (1, 1, 1)
    ready_cond = condition(ready, "Ready")
    assert ready_cond is not None and ready_cond["status"] == "True"
    assert ready_cond["observedGeneration"] == ready["metadata"]["generation"]
    assert ready_cond["lastTransitionTime"]
    assert condition(ready, "Progressing")["reason"] == "RolloutComplete"  # type: ignore[index]
    assert condition(ready, "Degraded")["status"] == "False"  # type: ignore[index]


def gone(cluster: MockCluster, kind: str) -> bool:
    return cluster.get(kind, NAME) is None


def im_status(cluster: MockCluster) -> dict[str, Any]:
    return dict((cluster.get("InferenceModel", NAME) or {}).get("status") or {})


def container_args(dep: dict[str, Any] | None) -> list[str]:
    assert dep is not None
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_update_rolls_out_the_new_spec(cluster: MockCluster, operator: Any) -> None:
    cluster.create("InferenceModel", im_doc())
    wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment")
    assert "--max-total-tokens" not in container_args(cluster.get("Deployment", NAME))

    cluster.patch("InferenceModel", NAME, {"spec": {"engine": {"maxModelLen": 4096, "dtype": "bfloat16"}}})
    dep = wait_for(
        lambda: (
            "--max-total-tokens" in container_args(cluster.get("Deployment", NAME))
            and cluster.get("Deployment", NAME)
        ),
        what="new args",
    )
    args = container_args(dep)
    assert args[args.index("--max-total-tokens") + 1] == "4096"
    assert args[args.index("--dtype") + 1] == "bfloat16"
    # The status follows the new generation.
    im = cluster.get("InferenceModel", NAME)
    assert im is not None and im["metadata"]["generation"] == 2
    wait_for(lambda: im_status(cluster).get("observedGeneration") == 2, what="observedGeneration 2")

    # Scaling out adds a PodDisruptionBudget; switching to an autoscaler hands it the replica count.
    cluster.patch("InferenceModel", NAME, {"spec": {"scaling": {"replicas": 2, "maxReplicas": 2}}})
    wait_for(lambda: (cluster.get("Deployment", NAME) or {})["spec"].get("replicas") == 2, what="replicas 2")
    wait_for(lambda: cluster.get("PodDisruptionBudget", NAME), what="PDB")
    cluster.patch(
        "InferenceModel",
        NAME,
        {"spec": {"scaling": {"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 4}}},
    )
    hpa = wait_for(lambda: cluster.get("HorizontalPodAutoscaler", NAME), what="HPA")
    assert hpa["spec"]["maxReplicas"] == 4
    # Up to 4 replicas but possibly 1: the budget turns into maxUnavailable 1 (never blocks a drain).
    wait_for(
        lambda: (cluster.get("PodDisruptionBudget", NAME) or {}).get("spec", {}).get("maxUnavailable") == 1,
        what="PDB maxUnavailable 1 (min 1)",
    )
    # Switching HPA -> KEDA replaces the autoscaler object, never leaving both.
    cluster.patch(
        "InferenceModel",
        NAME,
        {"spec": {"scaling": {"autoscaler": "KEDA", "prometheusAddress": "http://prom:9090"}}},
    )
    wait_for(lambda: cluster.get("ScaledObject", NAME), what="ScaledObject")
    wait_for(lambda: cluster.get("HorizontalPodAutoscaler", NAME) is None, what="HPA removed")


def test_drift_is_repaired(cluster: MockCluster, operator: Any) -> None:
    cluster.create("InferenceModel", im_doc())
    dep = wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment")
    wait_for(lambda: cluster.get("Service", NAME), what="Service")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]

    # A hand edit of a field the operator owns is reverted.
    containers = dep["spec"]["template"]["spec"]["containers"]
    cluster.patch(
        "Deployment",
        NAME,
        {
            "spec": {
                "template": {"spec": {"containers": [{**containers[0], "image": "attacker/image:latest"}]}}
            }
        },
    )
    wait_for(
        lambda: (
            (cluster.get("Deployment", NAME) or {})["spec"]["template"]["spec"]["containers"][0]["image"]
            == image
        ),
        what="image restored",
    )
    # A deleted child comes back, still owned by the model.
    old_uid = cluster.get("Service", NAME)["metadata"]["uid"]  # type: ignore[index]
    cluster.delete("Service", NAME)
    svc = wait_for(
        lambda: (s := cluster.get("Service", NAME)) is not None and s["metadata"]["uid"] != old_uid and s,
        what="Service recreated",
    )
    assert owned_by(svc, cluster.get("InferenceModel", NAME))  # type: ignore[arg-type]
    cluster.delete("Deployment", NAME)
    wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment recreated")
    assert len(cluster.live("Deployment")) == 1 and len(cluster.live("Service")) == 1


def test_suspend_scales_to_zero_and_back(cluster: MockCluster, operator: Any) -> None:
    spec = {
        "model": {"uri": "hf://org/model"},
        "scaling": {"autoscaler": "HPA", "minReplicas": 2, "maxReplicas": 5},
    }
    cluster.create("InferenceModel", im_doc(spec))
    wait_for(lambda: cluster.get("HorizontalPodAutoscaler", NAME), what="HPA")
    wait_for(lambda: cluster.get("PodDisruptionBudget", NAME), what="PDB")

    cluster.patch("InferenceModel", NAME, {"spec": {"suspend": True}})
    wait_for(lambda: (cluster.get("Deployment", NAME) or {})["spec"].get("replicas") == 0, what="replicas 0")
    wait_for(lambda: cluster.get("HorizontalPodAutoscaler", NAME) is None, what="HPA removed")
    wait_for(lambda: cluster.get("PodDisruptionBudget", NAME) is None, what="PDB removed")
    wait_for(lambda: im_status(cluster).get("phase") == "Suspended", what="phase Suspended")
    ready = condition(cluster.get("InferenceModel", NAME), "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "Suspended")

    cluster.patch("InferenceModel", NAME, {"spec": {"suspend": False}})
    wait_for(lambda: cluster.get("HorizontalPodAutoscaler", NAME), what="HPA back")
    wait_for(lambda: im_status(cluster).get("phase") == "Pending", what="phase Pending")


def test_delete_leaves_children_to_garbage_collection(cluster: MockCluster, operator: Any) -> None:
    cluster.create("InferenceModel", im_doc({"model": {"uri": "hf://org/model"}, "scaling": {"replicas": 2}}))
    for kind in ("Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget"):
        wait_for(functools.partial(cluster.get, kind, NAME), what=kind)
    cluster.delete("InferenceModel", NAME)
    # No finalizer holds the model back, and every child carried the owner reference the
    # (emulated) garbage collector follows.
    wait_for(lambda: cluster.get("InferenceModel", NAME) is None, what="model gone")
    for kind in ("Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget"):
        wait_for(functools.partial(gone, cluster, kind), what=f"{kind} collected")
    # And the operator does not resurrect them from child events: checked once its reconciles are over
    # (a fixed 0.5 s could end before a loaded machine ran them).
    wait_quiet(cluster)
    assert cluster.live("Deployment") == [] and cluster.live("Service") == []


def test_without_prometheus_operator_monitoring_is_unavailable(cluster_factory: Any) -> None:
    cluster = cluster_factory(monitoring=False)
    with run_operator():
        cluster.create("InferenceModel", im_doc())
        wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment")
        cond = wait_for(
            lambda: condition(cluster.get("InferenceModel", NAME), "MonitoringAvailable"), what="condition"
        )
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
        assert cluster.count_requests("PATCH", "servicemonitors") == 0


def test_invalid_spec_is_reported_and_nothing_is_applied(cluster: MockCluster, operator: Any) -> None:
    # Passes the CRD schema, but the server cannot run it: a managed flag in extraArgs.
    spec = {"model": {"uri": "hf://org/model"}, "engine": {"extraArgs": ["--port=9000"]}}
    cluster.create("InferenceModel", im_doc(spec))
    degraded = wait_for(lambda: condition(cluster.get("InferenceModel", NAME), "Degraded"), what="Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "--port" in degraded["message"]
    assert im_status(cluster)["phase"] == "Failed"
    assert cluster.get("Deployment", NAME) is None and cluster.get("Service", NAME) is None

    # Fixing the spec recovers.
    cluster.patch("InferenceModel", NAME, {"spec": {"engine": {"extraArgs": ["--block-size", "32"]}}})
    wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment after fix")
    wait_for(lambda: im_status(cluster).get("phase") == "Pending", what="phase Pending")
    assert condition(cluster.get("InferenceModel", NAME), "Degraded")["status"] == "False"  # type: ignore[index]


def test_spec_the_schema_would_reject_is_refused_too(cluster: MockCluster, operator: Any) -> None:
    # kmock does not enforce the CRD; the operator's own models still refuse the object.
    cluster.create("InferenceModel", im_doc({"model": {"uri": "ftp://host/model"}}))
    degraded = wait_for(lambda: condition(cluster.get("InferenceModel", NAME), "Degraded"), what="Degraded")
    assert degraded["reason"] == "InvalidSpec" and "model.uri must start with hf://" in degraded["message"]
    assert cluster.get("Deployment", NAME) is None
