"""Phase and conditions from the child Deployment and the reconcile outcome (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest
from kubeinfer_operator.spec import InferenceModel
from kubeinfer_operator.status import ReconcileOutcome, compute_status, failed_status, same_status
from op_testlib import inference_model

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def model(spec: dict[str, Any] | None = None, generation: int = 4) -> InferenceModel:
    doc = inference_model(
        spec or {"model": {"uri": "hf://o/m"}, "scaling": {"replicas": 2, "maxReplicas": 2}}
    )
    doc["metadata"] |= {"uid": "u1", "generation": generation}
    return InferenceModel.from_manifest(doc)


def deployment(
    replicas: int,
    ready: int,
    updated: int,
    conditions: list[dict[str, Any]] | None = None,
    spec_replicas: int = 2,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": 7},
        "spec": {"replicas": spec_replicas},
        "status": {
            "observedGeneration": 7,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions or [],
        },
    }


def conds(status: Any) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.to_dict()["conditions"]}


@pytest.mark.parametrize(
    ("dep", "phase", "ready_reason", "progressing"),
    [
        (None, "Pending", "NoReplicas", "True"),
        (deployment(0, 0, 0), "Pending", "NoReplicas", "True"),
        (deployment(2, 0, 2), "Loading", "ModelLoading", "True"),
        (deployment(2, 1, 2), "Ready", "ReplicasReady", "True"),
        (deployment(2, 2, 2), "Ready", "ReplicasReady", "False"),
    ],
)
def test_phase_from_deployment(dep: Any, phase: str, ready_reason: str, progressing: str) -> None:
    st = compute_status(model(), dep, ReconcileOutcome(), None, T0)
    c = conds(st)
    assert st.phase == phase
    assert c["Ready"]["reason"] == ready_reason
    assert c["Ready"]["status"] == ("True" if phase == "Ready" else "False")
    assert c["Progressing"]["status"] == progressing
    assert c["Degraded"]["status"] == "False"
    assert all(x["observedGeneration"] == 4 for x in c.values())
    assert st.observed_generation == 4
    assert st.endpoint == "http://m.default.svc:8080"


def test_stuck_rollout_is_degraded() -> None:
    stuck = deployment(
        2,
        1,
        1,
        [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "too slow",
            }
        ],
    )
    st = compute_status(model(), stuck, ReconcileOutcome(), None, T0)
    c = conds(st)
    assert st.phase == "Degraded"
    assert (c["Degraded"]["status"], c["Degraded"]["reason"], c["Degraded"]["message"]) == (
        "True",
        "ProgressDeadlineExceeded",
        "too slow",
    )
    failure = deployment(
        1, 0, 1, [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}]
    )
    assert (
        conds(compute_status(model(), failure, ReconcileOutcome(), None, T0))["Degraded"]["reason"]
        == "ReplicaFailure"
    )


def test_apply_error_then_recovery_keeps_the_story() -> None:
    failing = compute_status(
        model(), None, ReconcileOutcome(apply_error="applying Deployment: 500"), None, T0
    ).to_dict()
    assert failing["phase"] == "Degraded"
    assert conds_of(failing)["Degraded"] == {
        "type": "Degraded",
        "status": "True",
        "reason": "ApplyFailed",
        "message": "applying Deployment: 500",
        "observedGeneration": 4,
        "lastTransitionTime": T0,
    }
    healed = compute_status(model(), deployment(2, 2, 2), ReconcileOutcome(), failing, T1).to_dict()
    d = conds_of(healed)["Degraded"]
    assert (d["status"], d["reason"], d["lastTransitionTime"]) == ("False", "Recovered", T1)
    assert "applying Deployment: 500" in d["message"]
    # The note survives later refreshes until the next real transition.
    later = compute_status(
        model(), deployment(2, 2, 2), ReconcileOutcome(), healed, "2026-01-01T01:00:00Z"
    ).to_dict()
    assert conds_of(later)["Degraded"]["reason"] == "Recovered"
    assert conds_of(later)["Degraded"]["lastTransitionTime"] == T1
    assert same_status(healed, later)


def conds_of(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_transition_time_only_changes_on_transitions() -> None:
    a = compute_status(model(), deployment(2, 0, 2), ReconcileOutcome(), None, T0).to_dict()
    b = compute_status(model(), deployment(2, 0, 2), ReconcileOutcome(), a, T1).to_dict()
    assert conds_of(b)["Ready"]["lastTransitionTime"] == T0
    assert same_status(a, b)
    c = compute_status(model(), deployment(2, 2, 2), ReconcileOutcome(), b, T1).to_dict()
    assert conds_of(c)["Ready"]["lastTransitionTime"] == T1
    assert not same_status(b, c)


def test_suspended_invalid_and_monitoring() -> None:
    spec = {"model": {"uri": "hf://o/m"}, "suspend": True}
    st = compute_status(
        model(spec),
        deployment(0, 0, 0, spec_replicas=0),
        ReconcileOutcome(monitoring_skipped_reason="CRDNotInstalled"),
        None,
        T0,
    )
    c = conds(st)
    assert st.phase == "Suspended" and c["Ready"]["reason"] == "Suspended"
    assert (c["MonitoringAvailable"]["status"], c["MonitoringAvailable"]["reason"]) == (
        "False",
        "CRDNotInstalled",
    )
    invalid = compute_status(model(), None, ReconcileOutcome(invalid_spec="bad flag"), None, T0)
    assert invalid.phase == "Failed" and conds(invalid)["Degraded"]["message"] == "bad flag"
    assert invalid.endpoint is None
    failed = failed_status(9, "model.uri must start with", None, T0).to_dict()
    assert failed["phase"] == "Failed"
    assert conds_of(failed)["Degraded"]["reason"] == "InvalidSpec"
    assert conds_of(failed)["Ready"]["observedGeneration"] == 9


def test_autoscaled_desired_count_comes_from_the_deployment() -> None:
    spec = {"model": {"uri": "hf://o/m"}, "scaling": {"autoscaler": "HPA", "maxReplicas": 8}}
    st = compute_status(model(spec), deployment(5, 5, 5, spec_replicas=5), ReconcileOutcome(), None, T0)
    assert st.phase == "Ready"
    assert conds(st)["Progressing"]["reason"] == "RolloutComplete"
    assert conds(st)["Ready"]["message"] == "5/5 replicas ready"
