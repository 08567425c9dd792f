"""A model's children: the plan (render_all: every object the operator wants, and the optional
ones it wants absent) and the small renderers (Service, ServiceMonitor, HPA, ScaledObject, PDB). Pure;
the pods' template is deployment.py's, the shared helpers common.py's. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .adapters import configmap_name, render_adapters_configmap
from .cache import LoaderEstimate, adopts_claim, render_claim, render_job
from .canary import canary_child_refs, canary_view, canary_view_name
from .common import CACHE_DIR as CACHE_DIR
from .common import CONTAINER_NAME as CONTAINER_NAME
from .common import FIELD_MANAGER as FIELD_MANAGER
from .common import MODEL_ANNOTATION as MODEL_ANNOTATION
from .common import RUN_AS_USER as RUN_AS_USER
from .common import SERVER_PORT as SERVER_PORT
from .common import TMP_DIR as TMP_DIR
from .common import ChildRef as ChildRef
from .common import Manifest as Manifest
from .common import child_metadata, promql_string, render_service_account, selector_labels
from .common import desired_replicas as desired_replicas
from .common import endpoint_url as endpoint_url
from .common import labels as labels
from .common import selector_string as selector_string
from .common import startup_failure_threshold as startup_failure_threshold
from .defaults import ClusterDefaults
from .deployment import render_deployment
from .deployment import termination_grace_seconds as termination_grace_seconds
from .gateway import (
    EPP_KINDS,
    OBJECTIVE_KIND,
    POOL_KIND,
    ROUTE_KIND,
    GatewaySkip,
    epp_name,
    gateway_skipped,
    pool_name,
    render_gateway,
)
from .lws import render_leaderworkerset
from .names import derived_name
from .netpol import network_policies
from .quantity import same_quantity
from .render_activator import (
    ACTIVATOR_KINDS,
    activation_trigger,
    activator_name,
    render_activator,
    wants_activator,
)
from .routing import ROUTER_KINDS, render_router, router_name
from .spec import InferenceModel
from .workload import LWS_KIND, lws_name, multi_node, scale_target_ref, serving_selector_labels

METRIC_NAMES = {
    "QueueDepth": "vllm:num_requests_waiting",
    "KVCacheUsage": "vllm:kv_cache_usage_perc",
    "RunningRequests": "vllm:num_requests_running",
}


def pods_metric_name(metric: str) -> str:
    """Name of the per-pod custom metric the HPA reads (prometheus-adapter turns ':' into '_')."""
    return METRIC_NAMES[metric].replace(":", "_")


def render_service(im: InferenceModel) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(im),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector_labels(im),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_servicemonitor(im: InferenceModel) -> Manifest:
    sm = im.spec.monitoring.service_monitor
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(im, extra_labels=sm.labels),
        "spec": {
            "selector": {"matchLabels": selector_labels(im)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": sm.interval}],
        },
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a target; fractions go to milli-units ("0.8" -> "800m")."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def render_hpa(im: InferenceModel) -> Manifest:
    scaling = im.spec.scaling
    assert scaling.max_replicas is not None  # guaranteed by the spec validator for autoscaled models
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(im),
        "spec": {
            "scaleTargetRef": scale_target_ref(im),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": pods_metric_name(scaling.metric)},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": _quantity(scaling.effective_target),
                        },
                    },
                }
            ],
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds},
            },
        },
    }


def prometheus_query(im: InferenceModel) -> str:
    """Sum over the model's own pods; KEDA divides by the replica count for an AverageValue trigger.

    Scoped by the `service` label the Prometheus Operator puts on every series scraped through a
    ServiceMonitor (the model's Service), not only by the served name: two InferenceModels serving
    the same name in one namespace must not read each other's load.
    """
    metric = METRIC_NAMES[im.spec.scaling.metric]
    matchers = ",".join(
        [
            f"namespace={promql_string(im.namespace)}",
            f"service={promql_string(im.child_name)}",
            f"model_name={promql_string(im.spec.served_name)}",
        ]
    )
    return f"sum({metric}{{{matchers}}})"


def render_scaledobject(im: InferenceModel) -> Manifest:
    scaling = im.spec.scaling
    assert scaling.max_replicas is not None and scaling.prometheus_address is not None
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(im),
        "spec": {
            "scaleTargetRef": scale_target_ref(im),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "cooldownPeriod": scaling.scale_down_delay_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds}
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": scaling.prometheus_address,
                        "query": prometheus_query(im),
                        "threshold": str(scaling.effective_target),
                    },
                },
                *_activation_triggers(im),
            ],
        },
    }


def _activation_triggers(im: InferenceModel) -> list[dict[str, Any]]:
    return [activation_trigger(im)] if wants_activator(im) else []


def render_pdb(im: InferenceModel) -> Manifest:
    """minAvailable from the spec while at least two replicas always run (admission keeps it below
    that floor); otherwise (an autoscaler that may go down to one or zero) maxUnavailable 1, which
    never forbids every eviction however many replicas exist."""
    budget: dict[str, Any]
    # A multi-node replica is a group of pods that goes down as a unit (lws.py): one pod unavailable
    # at a time keeps at most one group down, which any admitted minAvailable allows.
    if im.spec.scaling.floor > 1 and im.spec.parallelism.nodes == 1:
        budget = {"minAvailable": im.spec.disruption.min_available}
    else:
        budget = {"maxUnavailable": 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(im),
        "spec": {**budget, "selector": {"matchLabels": selector_labels(im)}},
    }


def wants_pdb(im: InferenceModel) -> bool:
    """A PDB whenever more than one replica can exist (a fixed count above one, or an autoscaler
    allowed above one); with a single fixed replica it could only block node drains."""
    if im.spec.suspend:
        return False
    scaling = im.spec.scaling
    if im.spec.autoscaled:
        return (scaling.max_replicas or 0) > 1
    return scaling.replicas > 1


@dataclass(frozen=True)
class Capabilities:
    """Optional APIs found on the cluster, and the installation's defaults for the pods."""

    service_monitor: bool = True
    keda: bool = True
    defaults: ClusterDefaults = field(default_factory=ClusterDefaults)
    leader_worker_set: bool = True
    hpa: bool = True  # autoscaling/v2 HorizontalPodAutoscaler
    inference_pool: bool = True  # inference.networking.k8s.io/v1 InferencePool (spec.routing.gateway)
    http_route: bool = True  # gateway.networking.k8s.io/v1 HTTPRoute
    inference_objective: bool = True  # inference.networking.x-k8s.io/v1alpha2 (routing.gateway.priority)
    # The installation renders Inference Extension objects (chart inferenceExtension.enabled, which also
    # grants the RBAC): off, the operator neither writes nor reads those kinds.
    inference_extension: bool = True

    @property
    def objective_kind(self) -> bool:
        """InferenceObjective usable: served, and the installation renders the extension's kinds."""
        return self.inference_extension and self.inference_objective

    @property
    def gateway_kinds(self) -> tuple[bool, bool]:
        """(InferencePool, HTTPRoute) usable: served, and the installation renders them."""
        return (
            self.inference_extension and self.inference_pool,
            self.inference_extension and self.http_route,
        )


@dataclass(frozen=True)
class RenderPlan:
    """Every child the operator wants, plus the optional children it wants absent."""

    objects: list[Manifest]
    # Optional children the spec does not want: deleted if they exist and this model owns them.
    absent: list[ChildRef]
    monitoring_skipped_reason: str | None  # why no ServiceMonitor is rendered, if none is
    # "CRDNotInstalled" when the spec's autoscaler API is not served: the workload runs at its floor.
    autoscaling_skipped_reason: str | None = None
    # Why spec.routing.gateway's objects are not all rendered, or None.
    gateway_skipped: GatewaySkip | None = None


# Every kind the operator creates and owns (an ownerReference to the model): render_all's objects and
# the admin key's Secret (credentials.py). handlers.py watches each but the Secret.
OWNED_KINDS = (
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ServiceMonitor",
    "ScaledObject",
    "Job",
    "PersistentVolumeClaim",
    "ConfigMap",
    "NetworkPolicy",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "LeaderWorkerSet",
    "InferencePool",
    "HTTPRoute",
    "InferenceObjective",
    "Secret",
)
OPTIONAL_KINDS = ("ServiceMonitor", "HorizontalPodAutoscaler", "ScaledObject", "PodDisruptionBudget")


# Children of the shared cache (cache.py): applied before the rest, and the Job only when missing.
CACHE_KINDS = ("PersistentVolumeClaim", "Job")
# Children that only exist once a shared cache is filled.
WAIT_FOR_CACHE_KINDS = ("Deployment", "LeaderWorkerSet", "HorizontalPodAutoscaler", "ScaledObject")


def autoscaling_skipped(im: InferenceModel, caps: Capabilities) -> str | None:
    """ "CRDNotInstalled" when the spec's autoscaler (KEDA's ScaledObject, the HPA) is not served."""
    if not im.spec.autoscaled:
        return None
    served = caps.keda if im.spec.scaling.autoscaler == "KEDA" else caps.hpa
    return None if served else "CRDNotInstalled"


def autoscaling_floor(im: InferenceModel) -> int:
    """Replicas while the autoscaler's API is missing: its floor, and at least one, so the model serves."""
    return max(im.spec.scaling.min_replicas, 1)


def render_all(
    im: InferenceModel,
    caps: Capabilities | None = None,
    cache_ready: bool = True,
    estimate: LoaderEstimate | None = None,
) -> RenderPlan:
    """Every child. With cache.mode Shared the claim (unless adopted) and the loader Job come first;
    `cache_ready` False (the Job has not succeeded) leaves out the Deployment and its autoscaler, so
    no replica starts before the cache is filled (a Deployment that exists is left as it is);
    `estimate`: the loader's memory estimate (memory.py: the server pods' memory when the spec sets
    none)."""
    caps = caps or Capabilities()
    # The router's objects come first: callers index the plan by kind, and the model's own objects
    # (later, same kinds) must win there.
    router = render_router(
        im,
        service_monitor=caps.service_monitor and im.spec.monitoring.service_monitor.enabled,
        defaults=caps.defaults,
    )
    # Order matters for a partial failure: the Service and PDB exist before pods can serve or be evicted.
    activator = render_activator(
        im,
        service_monitor=caps.service_monitor and im.spec.monitoring.service_monitor.enabled,
        defaults=caps.defaults,
    )
    pool_ok, route_ok = caps.gateway_kinds
    gateway = render_gateway(im, pool_ok, route_ok, caps.defaults, caps.objective_kind)
    objects = [*activator, *router, *gateway, render_service(im)]
    # NetworkPolicies before any pod they fence (netpol.py)
    policies, unwanted_policies = network_policies(im, caps.defaults, caps.gateway_kinds[0])
    objects = policies + objects
    if im.spec.cache.shared:
        cache_objects = [render_job(im, caps.defaults)]
        if not adopts_claim(im):
            cache_objects.insert(0, render_claim(im))
        objects = cache_objects + objects
    # The pods' own ServiceAccount after their fences and claim, before any pod (the loader Job's
    # too) runs as it.
    service_account = render_service_account(im)
    if service_account is not None:
        first_pods = next(
            i for i, o in enumerate(objects) if o["kind"] not in ("NetworkPolicy", "PersistentVolumeClaim")
        )
        objects.insert(first_pods, service_account)
    if wants_pdb(im):
        objects.append(render_pdb(im))
    if im.spec.adapters:  # before the Deployment: its pods read their adapter list from it
        objects.append(render_adapters_configmap(im, child_metadata(im)))
    canary = canary_view(im)
    if canary is not None:
        # The canary's fence first, then its Service and pods (its pool and picker are render_gateway's).
        canary_policies, _ = network_policies(canary, caps.defaults, caps.gateway_kinds[0])
        objects = canary_policies + objects
        objects += [render_service(canary), render_deployment(canary, caps.defaults)]
    workload = (
        render_leaderworkerset(im, caps.defaults, estimate)
        if multi_node(im)
        else render_deployment(im, caps.defaults, estimate)
    )
    autoscaling_skip = autoscaling_skipped(im, caps)
    if autoscaling_skip is not None:
        # No autoscaler can own the count: the operator holds it at the floor (handover.py gives it
        # to the autoscaler once its API appears).
        workload["spec"] = {"replicas": autoscaling_floor(im), **workload["spec"]}
    objects.append(workload)
    skipped: str | None = None
    if not im.spec.monitoring.service_monitor.enabled:
        skipped = "Disabled"
    elif not caps.service_monitor:
        skipped = "CRDNotInstalled"
    else:
        objects.append(render_servicemonitor(im))
    if autoscaling_skip is not None:
        pass
    elif im.spec.autoscaled and im.spec.scaling.autoscaler == "HPA":
        objects.append(render_hpa(im))
    elif im.spec.autoscaled and im.spec.scaling.autoscaler == "KEDA":
        objects.append(render_scaledobject(im))
    # Every optional child that may exist, the router's in reverse apply order (pods go before the
    # Service and RBAC they use); whichever is not rendered now must not exist.
    optional = [ChildRef(kind, im.child_name) for kind in (*OPTIONAL_KINDS, "ServiceAccount")]
    optional.append(ChildRef("ConfigMap", configmap_name(im)))
    # The workload kind the spec does not use (a switch between one node and several); no
    # LeaderWorkerSet can exist where the cluster does not serve the kind.
    optional.append(ChildRef("Deployment", im.child_name))
    if caps.leader_worker_set:
        optional.append(ChildRef(LWS_KIND, lws_name(im)))
    optional += [ChildRef(kind, router_name(im)) for kind in reversed(ROUTER_KINDS)]
    optional += unwanted_policies
    optional += [ChildRef(kind, activator_name(im)) for kind in reversed(ACTIVATOR_KINDS)]
    # The gateway's objects: kinds the cluster does not serve cannot exist.
    if route_ok:
        optional.append(ChildRef(ROUTE_KIND, pool_name(im)))
    if caps.objective_kind:
        optional.append(ChildRef(OBJECTIVE_KIND, pool_name(im)))
    if pool_ok:
        optional.append(ChildRef(POOL_KIND, pool_name(im)))
        optional += [ChildRef(kind, epp_name(im)) for kind in reversed(EPP_KINDS)]
    # The canary's (canary.py): all of them go when spec.canary does (promotion or rollback).
    canary_name = canary_view_name(im)
    optional += canary_child_refs(im)
    if caps.objective_kind:
        optional.append(ChildRef(OBJECTIVE_KIND, canary_name))
    if pool_ok:
        optional.append(ChildRef(POOL_KIND, canary_name))
        optional += [ChildRef(kind, derived_name(canary_name, "epp")) for kind in reversed(EPP_KINDS)]
        optional.append(ChildRef("NetworkPolicy", derived_name(canary_name, "epp")))
    if not cache_ready:
        objects = [
            o
            for o in objects
            if not (
                o["kind"] in WAIT_FOR_CACHE_KINDS and o["metadata"]["name"] in (im.child_name, lws_name(im))
            )
        ]
    present = {ChildRef(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    # While the cache fills, the autoscaler of a Deployment that serves an older revision stays.
    absent = [
        ref
        for ref in optional
        if ref not in present and (cache_ready or ref.kind not in WAIT_FOR_CACHE_KINDS)
    ]
    return RenderPlan(
        objects=objects,
        absent=absent,
        monitoring_skipped_reason=skipped,
        autoscaling_skipped_reason=autoscaling_skip,
        gateway_skipped=gateway_skipped(
            im, caps.inference_pool, caps.http_route, caps.inference_extension, caps.inference_objective
        ),
    )


# Keys whose values are quantities: the API server rewrites them canonically ("0.5" -> "500m").
_QUANTITY_KEYS = frozenset({"requests", "limits", "sizeLimit"})


def is_subset(desired: Any, live: Any, quantities: bool = False) -> bool:
    """True if every field of `desired` has the same value in `live` (lists compared item by item).

    Used to detect hand edits of a child: the API server adds defaults, which are ignored here, and
    stores quantities canonically, which are compared by value.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and is_subset(v, live[k], quantities or k in _QUANTITY_KEYS) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v, quantities) for d, v in zip(desired, live, strict=True))
        )
    if quantities and desired != live and same_quantity(desired, live):
        return True
    if isinstance(desired, (int, float)) and isinstance(live, str):
        return str(desired) == live
    return bool(desired == live)
