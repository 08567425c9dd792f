"""Status tells the truth: the pods' own reasons (ImagePullBackOff, CrashLoopBackOff with the last
termination message, OOMKilled, Unschedulable with the scheduler's message), Degraded when a model
that served has no ready replica, Events on each transition, derived child names in a live cluster,
and a ServiceMonitor applied once its CRD appears after the model."""

from __future__ import annotations

import functools
from typing import Any

from kubeinfer_operator.names import child_name
from kubeinfer_operator.pods import diagnose
from kubeinfer_operator.render import MODEL_ANNOTATION
from kubeinfer_operator.spec import InferenceModel
from kubeinfer_operator.status import ReconcileOutcome, compute_status
from op_cluster import MONITORING, MockCluster, condition, run_operator, wait_for
from op_testlib import inference_model

NOW = "2026-01-01T00:00:00Z"
HF = {"uri": "hf://org/model"}


def model(spec: dict[str, Any] | None = None, name: str = "llm") -> InferenceModel:
    doc = inference_model(spec or {"model": HF}, name=name)
    doc["metadata"] |= {"uid": "u-1", "generation": 2}
    return InferenceModel.from_manifest(doc)


def deployment(replicas: int = 1, ready: int = 0) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
        },
    }


def pod(name: str = "llm-abc", waiting: str | None = None, message: str = "", **extra: Any) -> dict[str, Any]:
    cs: dict[str, Any] = {
        "name": "server",
        "ready": extra.pop("ready", False),
        "restartCount": extra.pop("restarts", 0),
    }
    if waiting is not None:
        cs["state"] = {"waiting": {"reason": waiting, "message": message}}
    if "last" in extra:
        cs["lastState"] = {"terminated": extra.pop("last")}
    status: dict[str, Any] = {"containerStatuses": [cs]}
    if "conditions" in extra:
        status = {"conditions": extra.pop("conditions")}
    return {"metadata": {"name": name}, "status": status}


def conds(status: Any) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.to_dict()["conditions"]}


def status_of(pods: list[dict[str, Any]], dep: dict[str, Any] | None = None, previous: Any = None) -> Any:
    return compute_status(model(), dep or deployment(), ReconcileOutcome(), previous, NOW, pods)


# ---------------------------------------------------------------- pure status


def test_image_pull_backoff_is_degraded_not_loading() -> None:
    st = status_of([pod(waiting="ImagePullBackOff", message='Back-off pulling image "x:nope"')])
    assert st.phase == "Degraded"
    c = conds(st)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "ImagePullBackOff"
    assert 'pulling image "x:nope"' in c["Degraded"]["message"] and "llm-abc" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "False"


def test_crash_loop_carries_the_last_termination_message() -> None:
    last = {"reason": "Error", "exitCode": 1, "message": "ValueError: unknown quantization 'q9'"}
    st = status_of([pod(waiting="CrashLoopBackOff", restarts=4, last=last)])
    c = conds(st)["Degraded"]
    assert (c["status"], c["reason"]) == ("True", "CrashLoopBackOff")
    assert "unknown quantization 'q9'" in c["message"] and "4 times" in c["message"]


def test_oom_killed_says_to_raise_memory() -> None:
    st = status_of([pod(waiting="CrashLoopBackOff", last={"reason": "OOMKilled", "exitCode": 137})])
    c = conds(st)["Degraded"]
    assert c["reason"] == "OOMKilled" and "resources.memory" in c["message"]


def test_unschedulable_carries_the_schedulers_reason() -> None:
    sched = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
    st = status_of([pod(conditions=[sched])])
    c = conds(st)["Degraded"]
    assert c["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in c["message"]


def test_missing_secret_is_reported() -> None:
    st = status_of([pod(waiting="CreateContainerConfigError", message='secret "hf-token" not found')])
    assert conds(st)["Degraded"]["reason"] == "CreateContainerConfigError"


def test_one_crashing_replica_beside_a_serving_one_keeps_ready() -> None:
    pods = [
        pod("a", ready=True),
        pod("b", waiting="CrashLoopBackOff", last={"reason": "Error", "exitCode": 2}),
    ]
    st = status_of(pods, deployment(replicas=2, ready=1))
    c = conds(st)
    assert st.phase == "Ready" and c["Ready"]["status"] == "True"
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "CrashLoopBackOff"


def test_a_model_that_served_and_lost_every_replica_is_degraded() -> None:
    ready = status_of([pod(ready=True)], deployment(1, 1)).to_dict()
    assert ready["phase"] == "Ready"
    lost = status_of([pod(ready=False)], deployment(1, 0), previous=ready).to_dict()
    assert lost["phase"] == "Degraded"
    d = {c["type"]: c for c in lost["conditions"]}["Degraded"]
    assert (d["status"], d["reason"]) == ("True", "NoReadyReplicas")
    still = status_of([pod(ready=False)], deployment(1, 0), previous=lost).to_dict()
    assert still["phase"] == "Degraded"  # stays Degraded, does not fall back to Loading
    # A model that never served is Loading, not Degraded.
    assert status_of([pod(ready=False)], deployment(1, 0)).phase == "Loading"


def test_terminating_pods_and_healthy_pods_report_nothing() -> None:
    gone = pod(waiting="CrashLoopBackOff")
    gone["metadata"]["deletionTimestamp"] = NOW
    assert diagnose([gone, pod(ready=True)]) is None


def test_suspended_ignores_pods() -> None:
    im = model({"model": HF, "suspend": True})
    st = compute_status(
        im, deployment(0, 0), ReconcileOutcome(), None, NOW, [pod(waiting="ImagePullBackOff")]
    )
    assert st.phase == "Suspended"


# ---------------------------------------------------------------- against kmock


def _kubelet_pod(cluster: MockCluster, im_name: str, waiting: str, message: str) -> None:
    """Play the ReplicaSet controller and the kubelet: a pod of the model that cannot start."""
    child = child_name(im_name)
    cluster.create(
        "Pod",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{child}-7d4b9-x2x4q",
                "labels": {
                    "app.kubernetes.io/name": "kubeinfer-server",
                    "app.kubernetes.io/instance": child,
                    "app.kubernetes.io/managed-by": "kubeinfer-operator",
                },
                "annotations": {MODEL_ANNOTATION: im_name},
            },
            "spec": {"containers": [{"name": "server", "image": "x"}]},
            "status": {
                "containerStatuses": [
                    {
                        "name": "server",
                        "ready": False,
                        "state": {"waiting": {"reason": waiting, "message": message}},
                    }
                ]
            },
        },
    )


def test_dotted_name_deploys_and_a_bad_image_shows_in_status_and_events(
    cluster: MockCluster, operator: Any
) -> None:
    name = "llama-3.1-8b"
    child = child_name(name)
    assert child != name
    cluster.create("InferenceModel", inference_model({"model": HF}, name=name))
    for kind in ("Service", "Deployment", "ServiceMonitor"):
        wait_for(functools.partial(cluster.get, kind, child), what=kind)
    st = wait_for(lambda: (cluster.get("InferenceModel", name) or {}).get("status"), what="status")
    assert st["endpoint"] == f"http://{child}.default.svc:8080"

    _kubelet_pod(cluster, name, "ImagePullBackOff", 'Back-off pulling image "ghcr.io/kubeinfer/server:nope"')
    degraded = wait_for(
        lambda: (
            (d := condition(cluster.get("InferenceModel", name), "Degraded"))
            and d["reason"] == "ImagePullBackOff"
            and d
        ),
        what="Degraded=ImagePullBackOff",
    )
    assert degraded["status"] == "True" and "server:nope" in degraded["message"]
    assert cluster.get("InferenceModel", name)["status"]["phase"] == "Degraded"  # type: ignore[index]

    def events() -> list[dict[str, Any]]:
        return [
            e
            for e in cluster.live("Event")
            if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == "ImagePullBackOff"
        ]

    (event, *_) = wait_for(events, what="a Warning event on the InferenceModel")
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "InferenceModel"


def test_service_monitor_appears_when_its_crd_is_installed_later(cluster_factory: Any) -> None:
    cluster = cluster_factory(monitoring=False)
    with run_operator():
        cluster.create("InferenceModel", inference_model({"model": HF}, name="llm"))
        wait_for(
            lambda: (
                (condition(cluster.get("InferenceModel", "llm"), "MonitoringAvailable") or {}).get("reason")
                == "CRDNotInstalled"
            ),
            what="CRDNotInstalled",
        )
        cluster.add_resources(MONITORING)  # the Prometheus Operator is installed afterwards
        wait_for(lambda: cluster.get("ServiceMonitor", "llm"), timeout=90, what="ServiceMonitor applied")
        wait_for(
            lambda: (
                (condition(cluster.get("InferenceModel", "llm"), "MonitoringAvailable") or {}).get("status")
                == "True"
            ),
            timeout=90,
            what="MonitoringAvailable=True",
        )
