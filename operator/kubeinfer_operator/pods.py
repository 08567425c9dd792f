"""What the pods of a model say about why it is not serving: the kubelet's and the scheduler's own
reasons (ImagePullBackOff, CrashLoopBackOff with the last termination message, OOMKilled,
Unschedulable with the scheduler's message, a missing Secret), which the Deployment never reports.
Pure functions over core/v1 Pod objects as the API returns them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Waiting reasons of a container that will not get better without a change (the kubelet's names).
IMAGE_REASONS = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"})
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
MAX_MESSAGE = 512


@dataclass(frozen=True)
class PodProblem:
    """The most telling failure among the pods; `reason` is a kubelet/scheduler reason in CamelCase."""

    reason: str
    message: str
    pod: str


def _trim(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _container_problem(pod_name: str, cs: dict[str, Any]) -> PodProblem | None:
    state = cs.get("state") or {}
    last = (cs.get("lastState") or {}).get("terminated") or {}
    waiting = state.get("waiting") or {}
    reason = waiting.get("reason") or ""
    if reason in IMAGE_REASONS or reason in CONFIG_REASONS:
        return PodProblem(reason, _trim(f"pod {pod_name}: {waiting.get('message') or reason}"), pod_name)
    if reason == "CrashLoopBackOff":
        if last.get("reason") == "OOMKilled":
            return PodProblem(
                "OOMKilled",
                _trim(f"pod {pod_name}: killed for exceeding its memory limit; raise resources.memory"),
                pod_name,
            )
        detail = (
            last.get("message") or f"exit code {last.get('exitCode', '?')} ({last.get('reason') or 'Error'})"
        )
        restarts = cs.get("restartCount", 0)
        return PodProblem(
            "CrashLoopBackOff",
            _trim(f"pod {pod_name} restarted {restarts} times; last exit: {detail}"),
            pod_name,
        )
    terminated = state.get("terminated") or {}
    if terminated.get("reason") == "OOMKilled" or (not cs.get("ready") and last.get("reason") == "OOMKilled"):
        return PodProblem(
            "OOMKilled",
            _trim(f"pod {pod_name}: killed for exceeding its memory limit; raise resources.memory"),
            pod_name,
        )
    return None


def _unschedulable(pod_name: str, pod: dict[str, Any]) -> PodProblem | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        pending = cond.get("type") == "PodScheduled" and cond.get("status") == "False"
        if pending and cond.get("reason") == "Unschedulable":
            message = _trim(f"pod {pod_name}: {cond.get('message') or 'no node fits'}")
            return PodProblem("Unschedulable", message, pod_name)
    return None


# The order a user should read them in: a problem of the spec (image, Secret) before a crash, a
# crash before a scheduling wait (which may resolve by itself when a node is added).
_PRIORITY = {
    **dict.fromkeys(IMAGE_REASONS, 0),
    **dict.fromkeys(CONFIG_REASONS, 0),
    "OOMKilled": 1,
    "CrashLoopBackOff": 2,
    "Unschedulable": 3,
}


def diagnose(pods: list[dict[str, Any]]) -> PodProblem | None:
    """The most telling problem among `pods` (terminating pods ignored), or None if none shows one."""
    found: list[PodProblem] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = str(meta.get("name") or "?")
        status = pod.get("status") or {}
        problem = _unschedulable(name, pod)
        if problem is not None:
            found.append(problem)
        for cs in list(status.get("initContainerStatuses") or []) + list(
            status.get("containerStatuses") or []
        ):
            problem = _container_problem(name, cs)
            if problem is not None:
                found.append(problem)
    if not found:
        return None
    return min(found, key=lambda p: (_PRIORITY.get(p.reason, 9), p.pod))
