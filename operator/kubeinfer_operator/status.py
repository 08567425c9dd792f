"""Status of an InferenceModel: phase and conditions, computed from the child Deployment and the
outcome of the last reconcile. Pure functions: the caller passes the current time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cache import CacheState
from .pods import diagnose
from .render import desired_replicas, endpoint_url, selector_string
from .render_activator import activator_url, zero_phase
from .spec import CacheStatus, Condition, InferenceModel, InferenceModelStatus, Phase


@dataclass(frozen=True)
class ReconcileOutcome:
    """What the last reconcile attempt found; None fields mean 'nothing to report'."""

    invalid_spec: str | None = None  # permanent: the spec cannot be deployed
    apply_error: str | None = None  # temporary: an API call failed, a retry is scheduled
    monitoring_skipped_reason: str | None = None  # "CRDNotInstalled" | "Disabled" | "NotApplied" | None
    cache: CacheState | None = None  # cache.mode Shared: the cache's phase as last judged
    # A precondition outside the spec is missing (e.g. an API the spec needs): nothing was applied.
    blocked_reason: str | None = None
    blocked_message: str = ""


def _deployment_condition(deployment: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    if deployment is None:
        return None
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def _counts(deployment: dict[str, Any] | None) -> tuple[int, int, int]:
    status = (deployment or {}).get("status") or {}
    return (
        int(status.get("replicas") or 0),
        int(status.get("readyReplicas") or 0),
        int(status.get("updatedReplicas") or 0),
    )


def _desired(im: InferenceModel, deployment: dict[str, Any] | None) -> int:
    if im.spec.replicas_delegated and deployment is not None:
        # The autoscaler (or the activator) owns the count; the Deployment's spec holds its latest decision.
        return int((deployment.get("spec") or {}).get("replicas") or 0)
    return desired_replicas(im)


def compute_status(
    im: InferenceModel,
    deployment: dict[str, Any] | None,
    outcome: ReconcileOutcome,
    previous: dict[str, Any] | None,
    now: str,
    pods: list[dict[str, Any]] | None = None,
) -> InferenceModelStatus:
    """Phase and conditions. `pods` (the model's pods, when listed) supply the kubelet's and the
    scheduler's reasons; a model that was ready and has no ready replica left is Degraded."""
    replicas, ready, updated = _counts(deployment)
    desired = _desired(im, deployment)
    generation = im.generation
    dep_generation_seen = deployment is not None and (deployment.get("status") or {}).get(
        "observedGeneration", 0
    ) >= (deployment.get("metadata") or {}).get("generation", 0)

    progressing_cond = _deployment_condition(deployment, "Progressing")
    failure_cond = _deployment_condition(deployment, "ReplicaFailure")
    stuck = progressing_cond is not None and progressing_cond.get("status") == "False"
    replica_failure = failure_cond is not None and failure_cond.get("status") == "True"

    degraded_reason: str | None = None
    degraded_message = ""
    if outcome.invalid_spec is not None:
        degraded_reason, degraded_message = "InvalidSpec", outcome.invalid_spec
    elif outcome.blocked_reason is not None:
        degraded_reason, degraded_message = outcome.blocked_reason, outcome.blocked_message
    elif outcome.apply_error is not None:
        degraded_reason, degraded_message = "ApplyFailed", outcome.apply_error
    elif stuck:
        assert progressing_cond is not None
        degraded_reason = str(progressing_cond.get("reason") or "ProgressDeadlineExceeded")
        degraded_message = str(progressing_cond.get("message") or "")
    elif replica_failure:
        assert failure_cond is not None
        degraded_reason = "ReplicaFailure"
        degraded_message = str(failure_cond.get("message") or "")
    # Pod-level reasons: serving replicas may remain (a bad rollout, one crashing replica).
    pod_problem = diagnose(pods or []) if not im.spec.suspend else None
    if degraded_reason is None and pod_problem is not None:
        degraded_reason, degraded_message = pod_problem.reason, pod_problem.message
    cache = outcome.cache
    cache_failed = cache is not None and cache.phase == "Failed"
    if degraded_reason is None and cache is not None and cache_failed:
        degraded_reason, degraded_message = cache.reason, cache.message
    prev_conditions = _previous_conditions(previous)
    was_serving = _was_serving(prev_conditions)
    if (
        degraded_reason is None
        and was_serving
        and ready == 0
        and desired > 0
        and not im.spec.suspend
        and outcome.invalid_spec is None
        and not im.spec.scale_to_zero  # woken from zero: Waking (below), not a lost replica
    ):
        degraded_reason = "NoReadyReplicas"
        degraded_message = "the model was serving and has no ready replica left"
    # Replicas of an earlier load keep serving while a new revision's loader fails.
    serving_despite = degraded_reason is not None and (pod_problem is not None or cache_failed) and ready >= 1
    waiting_for_cache = cache is not None and not cache.ready and deployment is None

    converged = (
        deployment is not None
        and dep_generation_seen
        and updated >= desired
        and ready >= desired
        and replicas == desired
    )

    phase: Phase
    if outcome.invalid_spec is not None:
        phase = "Failed"
    elif im.spec.suspend:
        phase = "Suspended"
    elif degraded_reason is not None and not serving_despite:
        phase = "Degraded"
    elif ready >= 1:
        phase = "Ready"
    elif replicas >= 1:
        phase = "Loading"
    else:
        phase = "Pending"
    phase = zero_phase(im, phase, desired, replicas, ready)

    def cond(ctype: str, status: str, reason: str, message: str) -> Condition:
        return make_condition(prev_conditions, generation, now, ctype, status, reason, message)

    conditions: list[Condition] = []
    if phase == "Ready":
        conditions.append(cond("Ready", "True", "ReplicasReady", f"{ready}/{desired} replicas ready"))
    else:
        reason = {
            "Failed": "InvalidSpec",
            "Suspended": "Suspended",
            "Degraded": degraded_reason or "Degraded",
            "Loading": "ModelLoading",
            "Pending": "CacheLoading" if waiting_for_cache else "NoReplicas",
            "ScaledToZero": "ScaledToZero",
            "Waking": "Waking",
        }[phase]
        conditions.append(cond("Ready", "False", reason, f"{ready}/{desired} replicas ready"))

    if outcome.invalid_spec is not None:
        conditions.append(cond("Progressing", "False", "InvalidSpec", "nothing is applied"))
    elif waiting_for_cache and not cache_failed:
        assert cache is not None
        conditions.append(cond("Progressing", "True", "CacheLoading", cache.message))
    elif converged:
        conditions.append(cond("Progressing", "False", "RolloutComplete", f"{updated} replicas up to date"))
    else:
        conditions.append(
            cond("Progressing", "True", "RollingOut", f"{updated}/{desired} replicas updated, {ready} ready")
        )

    if degraded_reason is not None:
        conditions.append(cond("Degraded", "True", degraded_reason, degraded_message))
    else:
        conditions.append(cond("Degraded", "False", "AsExpected", ""))

    if outcome.monitoring_skipped_reason == "CRDNotInstalled":
        conditions.append(
            cond(
                "MonitoringAvailable",
                "False",
                "CRDNotInstalled",
                "monitoring.coreos.com/v1 ServiceMonitor is not served by this cluster",
            )
        )
    elif outcome.monitoring_skipped_reason == "NotApplied":
        conditions.append(
            cond(
                "MonitoringAvailable",
                "False",
                "NotApplied",
                "the ServiceMonitor is wanted but not applied yet (a reconcile is pending)",
            )
        )
    elif outcome.monitoring_skipped_reason == "Disabled":
        conditions.append(
            cond(
                "MonitoringAvailable", "False", "Disabled", "spec.monitoring.serviceMonitor.enabled is false"
            )
        )
    elif outcome.invalid_spec is not None:
        conditions.append(cond("MonitoringAvailable", "Unknown", "InvalidSpec", ""))
    else:
        conditions.append(cond("MonitoringAvailable", "True", "ServiceMonitorApplied", ""))

    cache_status = None
    if cache is not None:
        if cache.ready:
            conditions.append(cond("CacheReady", "True", cache.reason or "Loaded", cache.message))
        else:
            conditions.append(cond("CacheReady", "False", cache.reason or cache.phase, cache.message))
        cache_status = CacheStatus(
            phase=cache.phase,  # type: ignore[arg-type]  # judged by cache.judge, one of CachePhase
            claim_name=cache.claim_name,
            job_name=cache.job_name,
            reason=cache.reason,
            message=cache.message,
        )

    return InferenceModelStatus(
        phase=phase,
        replicas=replicas,
        ready_replicas=ready,
        updated_replicas=updated,
        selector=selector_string(im),
        # A scale-to-zero model is called through its activator (the model's Service has no pod at 0).
        endpoint=(activator_url(im) if im.spec.scale_to_zero else endpoint_url(im))
        if outcome.invalid_spec is None
        else None,
        observed_generation=generation,
        conditions=conditions,
        cache=cache_status,
    )


def _was_serving(prev: dict[str, dict[str, Any]]) -> bool:
    """Whether the model served before: Ready was True, or it is already Degraded for losing that."""
    ready = prev.get("Ready") or {}
    degraded = prev.get("Degraded") or {}
    return ready.get("status") == "True" or (
        degraded.get("status") == "True" and degraded.get("reason") == "NoReadyReplicas"
    )


def _previous_conditions(previous: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (previous or {}).get("conditions") or []}


def make_condition(
    prev_conditions: dict[str, dict[str, Any]],
    generation: int | None,
    now: str,
    ctype: str,
    status: str,
    reason: str,
    message: str,
) -> Condition:
    prev = prev_conditions.get(ctype)
    transition = now
    if prev is not None and prev.get("status") == status:
        transition = prev.get("lastTransitionTime") or now
        # Keep a "Recovered" note until the next real transition, so the status still tells
        # what happened after the fault cleared.
        if ctype == "Degraded" and status == "False" and prev.get("reason") == "Recovered":
            reason, message = "Recovered", prev.get("message") or message
    elif (
        prev is not None
        and ctype == "Degraded"
        and status == "False"
        and prev.get("status") == "True"
        and prev.get("reason") == "ApplyFailed"
    ):
        reason = "Recovered"
        message = f"recovered from: {prev.get('message', '')}"
    return Condition.model_validate(
        {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": transition,
        }
    )


def failed_status(
    generation: int | None, message: str, previous: dict[str, Any] | None, now: str
) -> InferenceModelStatus:
    """Status for a spec that cannot even be parsed into a model: nothing is applied."""
    prev = _previous_conditions(previous)
    old = previous or {}
    return InferenceModelStatus(
        phase="Failed",
        replicas=int(old.get("replicas") or 0),
        ready_replicas=int(old.get("readyReplicas") or 0),
        updated_replicas=int(old.get("updatedReplicas") or 0),
        selector=old.get("selector"),
        observed_generation=generation,
        conditions=[
            make_condition(prev, generation, now, "Ready", "False", "InvalidSpec", message),
            make_condition(
                prev, generation, now, "Progressing", "False", "InvalidSpec", "nothing is applied"
            ),
            make_condition(prev, generation, now, "Degraded", "True", "InvalidSpec", message),
            make_condition(prev, generation, now, "MonitoringAvailable", "Unknown", "InvalidSpec", ""),
        ],
    )


def same_status(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Equal apart from timestamps, so unchanged status is not rewritten on every refresh."""
    if a is None:
        return False

    def strip(s: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in s.items() if k != "conditions"}
        out["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []
        ]
        return out

    return strip(a) == strip(b)
