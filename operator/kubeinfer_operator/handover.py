"""Handing a workload's spec.replicas (a Deployment's, or a multi-node model's LeaderWorkerSet's)
between the operator and an autoscaler without dropping
capacity, the way server-side apply documents it ("Transferring ownership",
https://kubernetes.io/docs/reference/using-api/server-side-apply/#transferring-ownership).

Who owns the count:
- scaling.autoscaler None: the operator (its apply sets spec.replicas = scaling.replicas; a
  `kubectl scale` of the Deployment is drift and is undone; scale the InferenceModel instead, whose
  /scale subresource writes scaling.replicas).
- HPA or KEDA: the autoscaler. The operator's apply omits spec.replicas. An apply that simply drops
  a field its manager owned would reset it to the default (1) and kill serving pods, so first a
  second field manager (HANDOVER_MANAGER) applies the current count alone, clamped into
  [minReplicas, maxReplicas]; only then does the operator's own apply stop naming the field. The
  autoscaler's next /scale write takes the field from the handover manager.
- Back to a fixed count: the operator's forced apply takes the field again (spec edit wins).
Pure functions; handlers.reconcile makes the calls."""

from __future__ import annotations

from typing import Any

from .common import FIELD_MANAGER
from .spec import InferenceModel
from .workload import workload_api_version, workload_kind, workload_name

HANDOVER_MANAGER = "kubeinfer-operator-handover"


def owns_replicas(deployment: dict[str, Any], manager: str = FIELD_MANAGER) -> bool:
    """Whether `manager` holds spec.replicas through an Apply (from metadata.managedFields)."""
    for entry in (deployment.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            return True
    return False


def handover_count(im: InferenceModel, deployment: dict[str, Any] | None) -> int:
    """The count to keep while an autoscaler takes over: the live count within the autoscaler's range
    (so capacity stays, and an HPA is never left at 0 replicas, where it does nothing)."""
    scaling = im.spec.scaling
    live = (
        int(((deployment or {}).get("spec") or {}).get("replicas") or 0)
        if deployment
        else scaling.min_replicas
    )
    upper = scaling.max_replicas if scaling.max_replicas is not None else live
    return max(scaling.min_replicas, min(live, upper))


def render_handover(im: InferenceModel, count: int) -> dict[str, Any]:
    """The handover manager's apply: the workload's identity and spec.replicas, nothing else (the
    Deployment, or the LeaderWorkerSet of a multi-node model, whose spec.replicas counts groups)."""
    return {
        "apiVersion": workload_api_version(im),
        "kind": workload_kind(im),
        "metadata": {"name": workload_name(im), "namespace": im.namespace},
        "spec": {"replicas": count},
    }
