"""Multi-node replicas under kopf's KopfRunner against kmock: nodes 2 applies a LeaderWorkerSet (and no
Deployment), the Service picks leaders, status follows the LWS's group counts; nodes back to 1 brings the
Deployment back and deletes the LWS; without the LWS API the model is Degraded with a reason that says
so, nothing is applied, and the LWS appears once the CRD is installed."""

from __future__ import annotations

import functools
from typing import Any

from kubeinfer_operator.lws import CRD_MISSING_REASON, WORKER_INDEX_LABEL
from kubeinfer_operator.render import MODEL_ANNOTATION
from op_cluster import LWS, MockCluster, condition, run_operator, wait_for
from op_testlib import inference_model
from test_op_kopf import NAME, owned_by

LWS_NAME = f"{NAME}-lws"
WAIT = 45.0  # seconds; the machine running the suite may be loaded
SPEC: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "engine": {"tensorParallelSize": 4},
    "resources": {"gpu": {"count": 2}},
    "parallelism": {"nodes": 2},
    "scaling": {"replicas": 2},
}


def _status(cluster: MockCluster) -> dict[str, Any]:
    return dict((cluster.get("InferenceModel", NAME) or {}).get("status") or {})


def mark_lws_ready(cluster: MockCluster, groups: int) -> None:
    """Play the LWS controller: report `groups` ready groups."""
    lws = cluster.get("LeaderWorkerSet", LWS_NAME)
    assert lws is not None
    cluster.patch(
        "LeaderWorkerSet",
        LWS_NAME,
        {
            "status": {
                "observedGeneration": lws["metadata"]["generation"],
                "replicas": groups,
                "readyReplicas": groups,
                "updatedReplicas": groups,
            }
        },
        subresource="status",
    )


def worker_pod(cluster: MockCluster, name: str, last_message: str) -> None:
    """Play the LWS controller and the kubelet: a worker pod (index 1) of the model crash-looping."""
    cluster.create(
        "Pod",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {
                    "app.kubernetes.io/name": "kubeinfer-server",
                    "app.kubernetes.io/instance": NAME,
                    "app.kubernetes.io/managed-by": "kubeinfer-operator",
                    "leaderworkerset.sigs.k8s.io/name": LWS_NAME,
                    WORKER_INDEX_LABEL: "1",
                },
                "annotations": {MODEL_ANNOTATION: NAME},
            },
            "spec": {"containers": [{"name": "server", "image": "x"}]},
            "status": {
                "containerStatuses": [
                    {
                        "name": "server",
                        "ready": False,
                        "restartCount": 3,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 1, "message": last_message}},
                    }
                ]
            },
        },
    )


def test_nodes_switch_between_leaderworkerset_and_deployment(cluster_factory: Any) -> None:
    cluster = cluster_factory()
    cluster.add_resources(LWS)
    with run_operator():
        im = cluster.create("InferenceModel", inference_model(SPEC, name=NAME))
        lws = wait_for(
            functools.partial(cluster.get, "LeaderWorkerSet", LWS_NAME), what="LeaderWorkerSet", timeout=WAIT
        )
        assert owned_by(lws, im)
        assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        svc = wait_for(functools.partial(cluster.get, "Service", NAME), what="Service", timeout=WAIT)
        assert svc["spec"]["selector"][WORKER_INDEX_LABEL] == "0"
        assert cluster.get("Deployment", NAME) is None

        mark_lws_ready(cluster, 2)
        status = wait_for(
            lambda: (s := _status(cluster)).get("phase") == "Ready" and s, what="Ready", timeout=WAIT
        )
        assert status["readyReplicas"] == 2
        assert (condition({"status": status}, "Progressing") or {}).get("reason") == "RolloutComplete"

        # A crashing worker pod (not a leader: no Service ever sees it) shows in status.
        worker_pod(cluster, f"{LWS_NAME}-1-1", "RuntimeError: NCCL timeout joining the group")
        degraded = wait_for(
            lambda: (
                (d := condition(cluster.get("InferenceModel", NAME), "Degraded"))
                and d["status"] == "True"
                and d
            ),
            what="Degraded by the worker pod",
            timeout=WAIT,
        )
        assert degraded["reason"] == "CrashLoopBackOff" and "NCCL timeout" in degraded["message"]
        assert f"{LWS_NAME}-1-1" in degraded["message"]
        assert _status(cluster)["phase"] == "Ready"  # the other group still serves

        # Drift on the LWS is repaired like on a Deployment.
        cluster.patch("LeaderWorkerSet", LWS_NAME, {"spec": {"leaderWorkerTemplate": {"size": 5}}})
        wait_for(
            lambda: (
                (cluster.get("LeaderWorkerSet", LWS_NAME) or {})["spec"]["leaderWorkerTemplate"]["size"] == 2
            ),
            what="LWS size restored",
            timeout=WAIT,
        )

        # Back to one node: a Deployment, the LWS deleted, the Service selecting every server pod.
        cluster.patch(
            "InferenceModel",
            NAME,
            {"spec": {"parallelism": {"nodes": 1}, "engine": {"tensorParallelSize": 2}}},
        )
        dep = wait_for(functools.partial(cluster.get, "Deployment", NAME), what="Deployment", timeout=WAIT)
        assert owned_by(dep, im)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        wait_for(lambda: cluster.get("LeaderWorkerSet", LWS_NAME) is None, what="LWS deleted", timeout=WAIT)
        # kmock merges an apply into the live object (a real API server drops the fields the manager
        # stopped applying): judge the operator's latest apply of the Service.
        wait_for(
            lambda: (
                (body := last_apply(cluster, "services", NAME)) is not None
                and WORKER_INDEX_LABEL not in body["spec"]["selector"]
            ),
            what="Service applied selecting every server pod",
            timeout=WAIT,
        )


def last_apply(cluster: MockCluster, plural: str, name: str) -> dict[str, Any] | None:
    applies = [
        r.data
        for r in list(cluster.server)
        if r.resource is not None
        and r.resource.plural == plural
        and r.name == name
        and "apply-patch" in (r.headers.get("Content-Type") or "")
    ]
    return dict(applies[-1]) if applies else None


def test_missing_lws_api_is_reported_and_reconciled_when_installed(cluster_factory: Any) -> None:
    cluster = cluster_factory()  # no LeaderWorkerSet API yet
    with run_operator():
        cluster.create("InferenceModel", inference_model(SPEC, name=NAME))
        degraded = wait_for(
            lambda: (
                (d := condition(cluster.get("InferenceModel", NAME), "Degraded"))
                and d["status"] == "True"
                and d
            ),
            what="Degraded condition",
            timeout=WAIT,
        )
        assert degraded["reason"] == CRD_MISSING_REASON
        assert "leaderworkerset.x-k8s.io/v1" in degraded["message"]
        assert _status(cluster)["phase"] == "Degraded"
        # Nothing is applied: no Deployment instead, no Service selecting pods that cannot exist.
        assert cluster.get("Deployment", NAME) is None and cluster.get("Service", NAME) is None

        cluster.add_resources(LWS)  # the LWS controller is installed afterwards
        wait_for(
            functools.partial(cluster.get, "LeaderWorkerSet", LWS_NAME), timeout=WAIT, what="LWS applied"
        )
        wait_for(
            lambda: (
                (condition(cluster.get("InferenceModel", NAME), "Degraded") or {}).get("status") == "False"
            ),
            timeout=WAIT,
            what="Degraded cleared",
        )


def test_an_hpa_takes_the_group_count_over_without_dropping_groups(cluster_factory: Any) -> None:
    from kubeinfer_operator.handover import HANDOVER_MANAGER, owns_replicas

    cluster = cluster_factory()
    cluster.add_resources(LWS)

    def groups() -> int | None:
        lws = cluster.get("LeaderWorkerSet", LWS_NAME)
        return None if lws is None else lws["spec"].get("replicas")

    with run_operator():
        cluster.create("InferenceModel", inference_model({**SPEC, "scaling": {"replicas": 3}}, name=NAME))
        wait_for(lambda: groups() == 3, what="3 groups", timeout=WAIT)
        hpa = {"scaling": {"autoscaler": "HPA", "minReplicas": 2, "maxReplicas": 6}}
        cluster.patch("InferenceModel", NAME, {"spec": hpa})
        target = wait_for(
            lambda: (
                (cluster.get("HorizontalPodAutoscaler", NAME) or {}).get("spec", {}).get("scaleTargetRef")
            ),
            what="HPA",
            timeout=WAIT,
        )
        assert target == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": LWS_NAME,
        }
        # The switch kept the 3 running groups (kmock resets a count its only manager stops applying).
        counts = [v["spec"].get("replicas") for v in cluster.history("LeaderWorkerSet", LWS_NAME)]
        assert min(c for c in counts[counts.index(3) :] if c is not None) == 3, counts
        lws = cluster.get("LeaderWorkerSet", LWS_NAME)
        assert lws is not None and HANDOVER_MANAGER in str(lws) and not owns_replicas(lws)
        # The HPA scales through the LWS scale subresource; a later spec edit does not fight it.
        cluster.patch(
            "LeaderWorkerSet",
            LWS_NAME,
            {"spec": {"replicas": 5}},
            subresource="scale",
            field_manager="horizontal-pod-autoscaler",
        )
        wait_for(lambda: groups() == 5, what="the HPA's count", timeout=WAIT)
        cluster.patch("InferenceModel", NAME, {"spec": {"scaling": {"maxReplicas": 8}}})
        wait_for(
            lambda: (
                (cluster.get("HorizontalPodAutoscaler", NAME) or {}).get("spec", {}).get("maxReplicas") == 8
            ),
            what="HPA edit",
            timeout=WAIT,
        )
        assert groups() == 5
