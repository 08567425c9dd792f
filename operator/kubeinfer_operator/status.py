"""Status of an InferenceModel: phase and conditions, computed from the child Deployment and the
outcome of the last reconcile. Pure functions: the caller passes the current time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cache import CacheState, LoaderEstimate
from .canary import canary_view
from .common import desired_replicas, endpoint_url, selector_string
from .gateway import GatewaySkip
from .memory import CONDITION as MEMORY_CONDITION
from .memory import estimate_status, memory_verdict
from .pods import diagnose
from .render_activator import activator_url, zero_phase
from .spec import CacheStatus, CanaryStatus, Condition, InferenceModel, InferenceModelStatus, Phase


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
    # "CRDNotInstalled": the spec's autoscaler API is not served; the workload runs at its floor.
    autoscaling_skipped_reason: str | None = None
    # spec.routing.gateway: why its objects are left out, or None.
    gateway_skipped: GatewaySkip | None = None
    # The loader's memory estimate of the current load (read now, or kept in status): memory.py.
    memory: LoaderEstimate | None = None


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


@dataclass(frozen=True)
class WorkloadCounts:
    """What the live workload (Deployment, or LeaderWorkerSet as lws.workload_view shapes it) reports."""

    replicas: int
    ready: int
    updated: int
    desired: int  # what the spec (or, autoscaled, the autoscaler's last decision) asks for
    generation_seen: bool  # the controller has observed the workload's latest spec
    stuck: dict[str, Any] | None  # Progressing=False (ProgressDeadlineExceeded)
    replica_failure: dict[str, Any] | None  # ReplicaFailure=True (quota, admission)


def workload_counts(im: InferenceModel, deployment: dict[str, Any] | None) -> WorkloadCounts:
    replicas, ready, updated = _counts(deployment)
    seen = deployment is not None and (deployment.get("status") or {}).get("observedGeneration", 0) >= (
        deployment.get("metadata") or {}
    ).get("generation", 0)
    progressing = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    return WorkloadCounts(
        replicas=replicas,
        ready=ready,
        updated=updated,
        desired=_desired(im, deployment),
        generation_seen=seen,
        stuck=progressing if progressing is not None and progressing.get("status") == "False" else None,
        replica_failure=failure if failure is not None and failure.get("status") == "True" else None,
    )


@dataclass(frozen=True)
class Degradation:
    """Why the model is Degraded (reason None: it is not), and whether replicas still serve despite it."""

    reason: str | None
    message: str = ""
    serving_despite: bool = False


def degradation(
    im: InferenceModel,
    counts: WorkloadCounts,
    outcome: ReconcileOutcome,
    pods: list[dict[str, Any]] | None,
    prev_conditions: dict[str, dict[str, Any]],
) -> Degradation:
    """The first of: an invalid spec, a missing precondition, a failed apply, a stuck rollout, a
    replica failure, a pod-level reason (the kubelet's, the scheduler's), a failed cache, and having
    lost every ready replica after serving."""
    # Pod-level reasons: serving replicas may remain (a bad rollout, one crashing replica).
    pod_problem = diagnose(pods or []) if not im.spec.suspend else None
    cache = outcome.cache
    cache_failed = cache is not None and cache.phase == "Failed"
    found: tuple[str, str] | None = None
    if outcome.invalid_spec is not None:
        found = ("InvalidSpec", outcome.invalid_spec)
    elif outcome.blocked_reason is not None:
        found = (outcome.blocked_reason, outcome.blocked_message)
    elif outcome.apply_error is not None:
        found = ("ApplyFailed", outcome.apply_error)
    elif counts.stuck is not None:
        found = (
            str(counts.stuck.get("reason") or "ProgressDeadlineExceeded"),
            str(counts.stuck.get("message") or ""),
        )
    elif counts.replica_failure is not None:
        found = ("ReplicaFailure", str(counts.replica_failure.get("message") or ""))
    elif pod_problem is not None:
        found = (pod_problem.reason, pod_problem.message)
    elif cache is not None and cache_failed:
        found = (cache.reason, cache.message)
    elif (
        _was_serving(prev_conditions)
        and counts.ready == 0
        and counts.desired > 0
        and not im.spec.suspend
        and not im.spec.scale_to_zero  # woken from zero: Waking (phase_of), not a lost replica
    ):
        found = ("NoReadyReplicas", "the model was serving and has no ready replica left")
    if found is None:
        return Degradation(None)
    # Replicas of an earlier load keep serving while a new revision's loader fails.
    despite = (pod_problem is not None or cache_failed) and counts.ready >= 1
    return Degradation(found[0], found[1], despite)


def phase_of(
    im: InferenceModel, counts: WorkloadCounts, outcome: ReconcileOutcome, degraded: Degradation
) -> Phase:
    if outcome.invalid_spec is not None:
        return "Failed"
    if im.spec.suspend:
        return "Suspended"
    if degraded.reason is not None and not degraded.serving_despite:
        return "Degraded"
    if counts.ready >= 1:
        phase: Phase = "Ready"
    elif counts.replicas >= 1:
        phase = "Loading"
    else:
        phase = "Pending"
    # a scale-to-zero model at or waking from zero replicas: ScaledToZero / Waking (render_activator.py)
    return zero_phase(im, phase, counts.desired, counts.replicas, counts.ready)


# A condition from (type, status, reason, message), keeping the previous transition time.
MakeCondition = Callable[[str, str, str, str], Condition]


def ready_condition(
    phase: Phase, counts: WorkloadCounts, degraded: Degradation, waiting_for_cache: bool, cond: MakeCondition
) -> Condition:
    summary = f"{counts.ready}/{counts.desired} replicas ready"
    if phase == "Ready":
        return cond("Ready", "True", "ReplicasReady", summary)
    reason = {
        "Failed": "InvalidSpec",
        "Suspended": "Suspended",
        "Degraded": degraded.reason or "Degraded",
        "Loading": "ModelLoading",
        "Pending": "CacheLoading" if waiting_for_cache else "NoReplicas",
        "ScaledToZero": "ScaledToZero",
        "Waking": "Waking",
    }[phase]
    return cond("Ready", "False", reason, summary)


def progressing_condition(
    counts: WorkloadCounts,
    outcome: ReconcileOutcome,
    deployment: dict[str, Any] | None,
    waiting_for_cache: bool,
    cond: MakeCondition,
) -> Condition:
    cache = outcome.cache
    converged = (
        deployment is not None
        and counts.generation_seen
        and counts.updated >= counts.desired
        and counts.ready >= counts.desired
        and counts.replicas == counts.desired
    )
    if outcome.invalid_spec is not None:
        return cond("Progressing", "False", "InvalidSpec", "nothing is applied")
    if waiting_for_cache and cache is not None and cache.phase != "Failed":
        return cond("Progressing", "True", "CacheLoading", cache.message)
    if converged:
        return cond("Progressing", "False", "RolloutComplete", f"{counts.updated} replicas up to date")
    return cond(
        "Progressing",
        "True",
        "RollingOut",
        f"{counts.updated}/{counts.desired} replicas updated, {counts.ready} ready",
    )


def degraded_condition(degraded: Degradation, cond: MakeCondition) -> Condition:
    if degraded.reason is not None:
        return cond("Degraded", "True", degraded.reason, degraded.message)
    return cond("Degraded", "False", "AsExpected", "")


_MONITORING_SKIPPED = {
    "CRDNotInstalled": "monitoring.coreos.com/v1 ServiceMonitor is not served by this cluster",
    "NotApplied": "the ServiceMonitor is wanted but not applied yet (a reconcile is pending)",
    "Disabled": "spec.monitoring.serviceMonitor.enabled is false",
}


def monitoring_condition(outcome: ReconcileOutcome, cond: MakeCondition) -> Condition:
    reason = outcome.monitoring_skipped_reason
    if reason is not None and reason in _MONITORING_SKIPPED:
        return cond("MonitoringAvailable", "False", reason, _MONITORING_SKIPPED[reason])
    if outcome.invalid_spec is not None:
        return cond("MonitoringAvailable", "Unknown", "InvalidSpec", "")
    return cond("MonitoringAvailable", "True", "ServiceMonitorApplied", "")


def gateway_condition(outcome: ReconcileOutcome, cond: MakeCondition) -> Condition:
    """For spec.routing.gateway: whether the Inference Extension's pool (and route) are in place; the
    model serves through its own Service either way."""
    skip = outcome.gateway_skipped
    if skip is not None:
        return cond(
            "GatewayAvailable", "False", skip.reason, f"{skip.message}: the model serves through its Service"
        )
    return cond("GatewayAvailable", "True", "InferencePoolApplied", "")


def autoscaling_condition(im: InferenceModel, outcome: ReconcileOutcome, cond: MakeCondition) -> Condition:
    """For an autoscaled spec: whether its autoscaler's API is served (else the floor runs)."""
    keda = im.spec.scaling.autoscaler == "KEDA"
    kind = "ScaledObject" if keda else "HorizontalPodAutoscaler"
    if outcome.autoscaling_skipped_reason == "CRDNotInstalled":
        api = "keda.sh/v1alpha1 ScaledObject" if keda else "autoscaling/v2 HorizontalPodAutoscaler"
        return cond(
            "AutoscalingAvailable",
            "False",
            "CRDNotInstalled",
            f"{api} is not served by this cluster: the model runs at its floor of "
            f"{max(im.spec.scaling.min_replicas, 1)} replica(s) until it is",
        )
    return cond("AutoscalingAvailable", "True", f"{kind}Applied", "")


def cache_condition(cache: CacheState, cond: MakeCondition) -> tuple[Condition, CacheStatus]:
    if cache.ready:
        condition = cond("CacheReady", "True", cache.reason or "Loaded", cache.message)
    else:
        condition = cond("CacheReady", "False", cache.reason or cache.phase, cache.message)
    status = CacheStatus(
        phase=cache.phase,  # type: ignore[arg-type]  # judged by cache.judge, one of CachePhase
        claim_name=cache.claim_name,
        job_name=cache.job_name,
        reason=cache.reason,
        message=cache.message,
    )
    return condition, status


def compute_status(
    im: InferenceModel,
    deployment: dict[str, Any] | None,
    outcome: ReconcileOutcome,
    previous: dict[str, Any] | None,
    now: str,
    pods: list[dict[str, Any]] | None = None,
    canary_deployment: dict[str, Any] | None = None,
) -> InferenceModelStatus:
    """Phase and conditions (`canary_deployment`: spec.canary's live Deployment, for status.canary). `pods` (the model's pods, when listed) supply the kubelet's and the
    scheduler's reasons; a model that was ready and has no ready replica left is Degraded."""
    prev_conditions = _previous_conditions(previous)
    counts = workload_counts(im, deployment)
    degraded = degradation(im, counts, outcome, pods, prev_conditions)
    phase = phase_of(im, counts, outcome, degraded)
    cache = outcome.cache
    waiting_for_cache = cache is not None and not cache.ready and deployment is None

    def cond(ctype: str, status: str, reason: str, message: str) -> Condition:
        return make_condition(prev_conditions, im.generation, now, ctype, status, reason, message)

    conditions = [
        ready_condition(phase, counts, degraded, waiting_for_cache, cond),
        progressing_condition(counts, outcome, deployment, waiting_for_cache, cond),
        degraded_condition(degraded, cond),
        monitoring_condition(outcome, cond),
    ]
    if im.spec.autoscaled and outcome.invalid_spec is None:
        conditions.append(autoscaling_condition(im, outcome, cond))
    if im.spec.routing.gateway.enabled and outcome.invalid_spec is None:
        conditions.append(gateway_condition(outcome, cond))
    cache_status = None
    if cache is not None:
        cache_cond, cache_status = cache_condition(cache, cond)
        conditions.append(cache_cond)
    memory_status = None
    if outcome.memory is not None and outcome.invalid_spec is None:
        memory_status = estimate_status(im, outcome.memory)
        verdict = memory_verdict(im, outcome.memory)
        conditions.append(cond(MEMORY_CONDITION, verdict.status, verdict.reason, verdict.message))
    canary_status = None
    if outcome.invalid_spec is None:
        canary = canary_of(im, canary_deployment)
        if canary is not None:
            canary_status = canary
            conditions.append(canary_condition(canary, outcome, cond))
    return InferenceModelStatus(
        phase=phase,
        replicas=counts.replicas,
        ready_replicas=counts.ready,
        updated_replicas=counts.updated,
        selector=selector_string(im),
        # A scale-to-zero model is called through its activator (the model's Service has no pod at 0).
        endpoint=(activator_url(im) if im.spec.scale_to_zero else endpoint_url(im))
        if outcome.invalid_spec is None
        else None,
        observed_generation=im.generation,
        conditions=conditions,
        cache=cache_status,
        canary=canary_status,
        memory_estimate=memory_status,
    )


def canary_of(im: InferenceModel, deployment: dict[str, Any] | None) -> CanaryStatus | None:
    """status.canary from the canary's Deployment (None without spec.canary)."""
    view = canary_view(im)
    if view is None or im.spec.canary is None:
        return None
    counts = workload_counts(view, deployment)
    return CanaryStatus(
        model=im.spec.canary.model.uri,
        weight=im.spec.canary.weight,
        replicas=counts.replicas,
        ready_replicas=counts.ready,
        desired_replicas=counts.desired,
    )


def canary_condition(canary: CanaryStatus, outcome: ReconcileOutcome, cond: MakeCondition) -> Condition:
    """CanaryReady: every wanted canary replica ready (a canary of 0 replicas is paused: False), and
    whether the gateway splits traffic to it at all."""
    share = f"{canary.weight}% of the gateway's traffic"
    if outcome.gateway_skipped is not None:
        share = f"no traffic split ({outcome.gateway_skipped.reason}): clients reach the stable Service only"
    ready = f"{canary.ready_replicas}/{canary.desired_replicas} canary replicas ready"
    if canary.desired_replicas == 0:
        return cond(
            "CanaryReady",
            "False",
            "Paused",
            f"no canary replica wanted (canary.replicas 0, or suspend); {share}",
        )
    if canary.ready_replicas >= canary.desired_replicas:
        return cond("CanaryReady", "True", "ReplicasReady", f"{ready}; {share}")
    return cond("CanaryReady", "False", "ReplicasNotReady", f"{ready}; {share}")


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
