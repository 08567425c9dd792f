"""Pure renderers for scale to zero (`scaling.minReplicas: 0`): the model's activator.

The activator (kubeinfer_operator/activator, in the operator's image) is its own Deployment and Service
`<name>-activator` in front of the model's Service (or its router when spec.routing is on): clients call
it to get requests held while the model is at zero replicas. Its Role reads the model's workload and
writes only its scale subresource, both by name. It depends on neither the operator nor its leader: an
operator failover does not touch the data path. One replica: its idle decision needs every request it
judges by (two activators would each see part of the traffic).
"""

from __future__ import annotations

from typing import Any

from .common import (
    SERVER_PORT,
    Manifest,
    api_service_account,
    labels,
    own_role_binding,
    owner_reference,
    promql_string,
    restricted_container_security_context,
    role,
)
from .defaults import ClusterDefaults
from .names import derived_name
from .routing import ROUTER_PORT, router_name, wants_router
from .spec import InferenceModel, Phase
from .workload import multi_node, workload_kind, workload_name

ACTIVATOR_PORT = 8000
# What the server admits by default (server/cli.py --max-concurrent-requests).
SERVER_DEFAULT_MAX_CONCURRENT_REQUESTS = 128
# Every kind render_activator may produce, in apply order (all named activator_name).
ACTIVATOR_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment", "ServiceMonitor")


def activator_name(im: InferenceModel) -> str:
    return derived_name(im.child_name, "activator")


def wants_activator(im: InferenceModel) -> bool:
    return im.spec.scale_to_zero


def activator_selector_labels(im: InferenceModel) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kubeinfer-activator", "app.kubernetes.io/instance": im.child_name}


def _meta(im: InferenceModel, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": activator_name(im),
        "namespace": im.namespace,
        "labels": {
            **(extra_labels or {}),
            **labels(im),
            **activator_selector_labels(im),
            "app.kubernetes.io/component": "activator",
        },
    }
    if im.uid is not None:
        meta["ownerReferences"] = [owner_reference(im)]
    return meta


def upstream_url(im: InferenceModel) -> str:
    """Where held requests go: the router when spec.routing is on, else the model's Service."""
    if wants_router(im):
        return f"http://{router_name(im)}.{im.namespace}.svc:{ROUTER_PORT}"
    return f"http://{im.child_name}.{im.namespace}.svc:{SERVER_PORT}"


def activator_url(im: InferenceModel) -> str:
    return f"http://{activator_name(im)}.{im.namespace}.svc:{ACTIVATOR_PORT}"


def per_replica_limit(im: InferenceModel) -> int:
    """Requests one replica (one LWS group) admits at once: its --max-concurrent-requests."""
    return im.spec.engine.max_concurrent_requests or SERVER_DEFAULT_MAX_CONCURRENT_REQUESTS


def max_wait_seconds(im: InferenceModel) -> int:
    """scaling.maxWaitSeconds, else the start-up budget the probes give a replica."""
    return im.spec.scaling.max_wait_seconds or im.spec.probes.startup_timeout_seconds


def wake_replicas(im: InferenceModel) -> int:
    """Replicas a wake-up asks for: scaling.replicas on the built-in path, one under KEDA (its HPA
    takes over from there)."""
    return 1 if im.spec.scaling.autoscaler == "KEDA" else im.spec.scaling.replicas


def activator_args(im: InferenceModel) -> list[str]:
    scaling = im.spec.scaling
    return [
        "--namespace",
        im.namespace,
        "--name",
        workload_name(im),
        "--kind",
        workload_kind(im),
        "--upstream",
        upstream_url(im),
        "--port",
        str(ACTIVATOR_PORT),
        "--max-held-requests",
        str(scaling.max_held_requests),
        "--max-wait-seconds",
        str(max_wait_seconds(im)),
        "--max-concurrent-requests",
        str(per_replica_limit(im)),
        "--wake-replicas",
        str(wake_replicas(im)),
        "--scale-down-delay-seconds",
        str(scaling.scale_down_delay_seconds),
        # Under KEDA, KEDA wakes (activation trigger on the activator's pending metric) and scales to
        # zero (cooldownPeriod) itself: a wake-up written here could be undone by KEDA before
        # Prometheus has scraped the held requests.
        *(["--wake", "--idle-scale-down"] if builtin_path(im) else ["--no-wake", "--no-idle-scale-down"]),
    ]


def builtin_path(im: InferenceModel) -> bool:
    """Scale to zero without an autoscaler: the activator writes both the wake-up and the scale-down."""
    return im.spec.scaling.autoscaler == "None"


def render_activator_role(im: InferenceModel) -> Manifest:
    if multi_node(im):
        group, plural = "leaderworkerset.x-k8s.io", "leaderworkersets"
    else:
        group, plural = "apps", "deployments"
    name = [workload_name(im)]
    rules: list[dict[str, Any]] = [
        {"apiGroups": [group], "resources": [plural], "resourceNames": name, "verbs": ["get"]}
    ]
    if builtin_path(im):  # under KEDA it only reads
        rules.append(
            {
                "apiGroups": [group],
                "resources": [f"{plural}/scale"],
                "resourceNames": name,
                "verbs": ["get", "patch"],
            }
        )
    return role(_meta(im), rules)


def render_activator_deployment(im: InferenceModel, defaults: ClusterDefaults | None = None) -> Manifest:
    defaults = defaults or ClusterDefaults()
    res = {"cpu": "250m", "memory": "128Mi"}
    container: dict[str, Any] = {
        "name": "activator",
        "image": defaults.activator_image,
        "command": ["python", "-m", "kubeinfer_operator.activator"],
        "args": activator_args(im),
        "ports": [{"name": "http", "containerPort": ACTIVATOR_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/activator/healthz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/activator/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {"requests": dict(res), "limits": {"memory": res["memory"]}},
        "securityContext": restricted_container_security_context(),
    }
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(im),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": activator_selector_labels(im)},
            # Recreate: two activators would each judge idleness from half the traffic.
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": {**labels(im), **activator_selector_labels(im)}},
                "spec": {
                    "serviceAccountName": activator_name(im),
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                },
            },
        },
    }
    pull_secrets = defaults.pull_secrets([])
    if pull_secrets:
        out["spec"]["template"]["spec"]["imagePullSecrets"] = pull_secrets
    return out


def render_activator(
    im: InferenceModel, service_monitor: bool = True, defaults: ClusterDefaults | None = None
) -> list[Manifest]:
    """Every activator object in apply order (RBAC before its pod); [] unless the model scales to zero.
    service_monitor: whether the ServiceMonitor CRD is installed and monitoring is enabled."""
    if not wants_activator(im):
        return []
    objects: list[Manifest] = [
        api_service_account(_meta(im)),  # it reads and scales the workload through the API
        render_activator_role(im),
        own_role_binding(_meta(im)),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(im),
            "spec": {
                "type": "ClusterIP",
                "selector": activator_selector_labels(im),
                "ports": [{"name": "http", "port": ACTIVATOR_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        },
        render_activator_deployment(im, defaults),
    ]
    if service_monitor:
        sm = im.spec.monitoring.service_monitor
        objects.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata": _meta(im, extra_labels=sm.labels),
                "spec": {
                    "selector": {"matchLabels": activator_selector_labels(im)},
                    "endpoints": [{"port": "http", "path": "/activator/metrics", "interval": sm.interval}],
                },
            }
        )
    return objects


def activation_trigger(im: InferenceModel) -> dict[str, Any]:
    """The ScaledObject trigger that wakes a KEDA-scaled model from zero and keeps it up while requests
    are held or in flight or a replica loads: the activator's `kubeinfer_activator_pending` metric,
    active above 0 (KEDA's activationThreshold), per replica against what one replica admits."""
    assert im.spec.scaling.prometheus_address is not None
    matchers = ",".join(
        [
            f"namespace={promql_string(im.namespace)}",
            f"service={promql_string(activator_name(im))}",
            f"model_name={promql_string(workload_name(im))}",
        ]
    )
    return {
        "type": "prometheus",
        "name": "activator",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": im.spec.scaling.prometheus_address,
            "query": f"sum(kubeinfer_activator_pending{{{matchers}}})",
            "threshold": str(per_replica_limit(im)),
            "activationThreshold": "0",
        },
    }


def zero_phase(im: InferenceModel, phase: Phase, desired: int, replicas: int, ready: int) -> Phase:
    """The status phase of a scale-to-zero model (status.compute_status's hook): ScaledToZero at zero
    replicas, Waking from a wake-up until a replica is ready; `phase` otherwise, and always for
    Failed, Suspended and Degraded (a crash-looping or unschedulable replica is not just waking)."""
    if not im.spec.scale_to_zero or phase in ("Failed", "Suspended", "Degraded", "Ready"):
        return phase
    if desired == 0 and replicas == 0:
        return "ScaledToZero"
    if desired > 0 and ready == 0:
        return "Waking"
    return phase
