"""spec.canary: a second version of a model served beside the stable one, and the traffic split.

Design (after KServe's `canaryTrafficPercent` and the Gateway API's weighted `backendRefs`): the
canary is the same InferenceModel rendered a second time (`canary_view`) with canary.model as its
source, `canary.replicas` pods, no autoscaler, router or PDB, under the child name `<child>-canary`
and the extra label `kubeinfer.dev/variant: canary`. It gets its own Deployment, Service,
NetworkPolicy and, through the gateway renderers, its own InferencePool and endpoint picker; the
stable model's HTTPRoute then carries two backendRefs, the stable pool at `100 - weight` and the
canary pool at `weight` (gateway.render_http_route). Weight 0 keeps the canary running (its own
Service answers for smoke tests) with no gateway traffic; weight 100 sends all gateway traffic to it.
Both versions answer to the stable's served name, so a client cannot tell which one it reached.

Only the Gateway API can weigh two Deployments: a Service spreads by endpoints, and vllm-router 0.1.17
has no per-worker weights, so spec.py refuses a canary without `routing.gateway.gatewayRef` or with
`routing.enabled` (and with a shared cache, several nodes per replica or scale to zero, which would
need a second loader, LeaderWorkerSet or activator). Promotion is an edit: canary.model moves into
model and canary goes; the stable Deployment rolls to the new source and the canary's children are
deleted (render.render_all lists them absent). The ServiceAccount, admin key and adapter ConfigMap
are the stable's (`InferenceModel.base_child_name`), shared by both versions.
"""

from __future__ import annotations

from dataclasses import replace

from .common import ChildRef
from .spec import InferenceModel

# The canary's children by kind, in reverse apply order (the endpoint picker's are gateway.py's).
CANARY_KINDS = ("Deployment", "Service", "NetworkPolicy")


def canary_view(im: InferenceModel) -> InferenceModel | None:
    """The canary variant of `im` (None without spec.canary): spec.canary.model as its model, answering
    to the stable's served name, `canary.replicas` fixed replicas."""
    canary = im.spec.canary
    if canary is None or im.variant == "canary":
        return None
    spec = im.spec
    scaling = spec.scaling.model_copy(
        update={
            "autoscaler": "None",
            "replicas": canary.replicas,
            # 0 replicas is a paused canary, not scale to zero (no activator: minReplicas 0 with replicas 0)
            "min_replicas": min(canary.replicas, 1),
            "max_replicas": None,
        }
    )
    view_spec = spec.model_copy(
        update={
            "model": canary.model.model_copy(update={"served_name": spec.served_name}),
            "canary": None,
            "scaling": scaling,
            "routing": spec.routing.model_copy(update={"enabled": False}),
        }
    )
    return replace(im, spec=view_spec, variant="canary")


def canary_weight(im: InferenceModel) -> int:
    """Percent of the gateway's traffic for the canary (0 without one)."""
    return im.spec.canary.weight if im.spec.canary is not None else 0


def canary_child_refs(im: InferenceModel) -> list[ChildRef]:
    """The canary's own children (not its endpoint picker's), whether or not the spec has a canary."""
    name = canary_view_name(im)
    return [ChildRef(kind, name) for kind in CANARY_KINDS]


def canary_view_name(im: InferenceModel) -> str:
    return replace(im, variant="canary").child_name
