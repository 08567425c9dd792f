"""Pure renderers for `spec.routing`: vLLM's router (vllm-router) in front of a model's replicas.

The router Deployment discovers the model's pods by their labels (`--service-discovery`, namespace
scoped, hence a Role to get/list/watch pods and nothing else), checks each on `/ready` (503 while
loading or draining, so such a replica gets no traffic), retries a failed request on another replica,
and exposes Prometheus metrics on its own port. Clients call the `<name>-router` Service; the
per-replica Service `<name>` stays for direct access. With `policy: kv_aware` the servers also publish
vLLM's KV-cache events (ZMQ, ports below); the router learns each discovered pod's event endpoints
from the pod's GET /kv_event_sources and subscribes to them for its KV index.
"""

from __future__ import annotations

import json
from typing import Any

from .common import (
    SERVER_PORT,
    Manifest,
    api_service_account,
    labels,
    own_role_binding,
    owner_reference,
    restricted_container_security_context,
    role,
)
from .defaults import ClusterDefaults
from .names import derived_name
from .spec import InferenceModel
from .workload import serving_selector_labels

ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
ROUTER_RETRIES = 3
# Every kind render_router may produce, in apply order (all named router_name).
ROUTER_KINDS = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Service",
    "PodDisruptionBudget",
    "Deployment",
    "ServiceMonitor",
)


def router_name(im: InferenceModel) -> str:
    return derived_name(im.child_name, "router")


def router_selector_labels(im: InferenceModel) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kubeinfer-router", "app.kubernetes.io/instance": im.child_name}


def _router_metadata(im: InferenceModel, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": router_name(im),
        "namespace": im.namespace,
        "labels": {
            **(extra_labels or {}),
            **labels(im),
            **router_selector_labels(im),
            "app.kubernetes.io/component": "router",
        },
    }
    if im.uid is not None:
        meta["ownerReferences"] = [owner_reference(im)]
    return meta


def wants_router(im: InferenceModel) -> bool:
    return im.spec.routing.enabled


def kv_events_config() -> str:
    """The servers' --kv-events-config (vLLM's JSON) under policy kv_aware."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
        },
        separators=(",", ":"),
    )


def server_routing_args(im: InferenceModel) -> list[str]:
    """Flags the server container gets from spec.routing (none unless kv_aware routing is on)."""
    if wants_router(im) and im.spec.routing.policy == "kv_aware":
        return ["--kv-events-config", kv_events_config()]
    return []


def server_routing_ports(im: InferenceModel) -> list[dict[str, Any]]:
    if wants_router(im) and im.spec.routing.policy == "kv_aware":
        return [
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"},
        ]
    return []


def router_args(im: InferenceModel) -> list[str]:
    routing = im.spec.routing
    selector = [f"{k}={v}" for k, v in serving_selector_labels(im).items()]
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_PORT),
        "--policy",
        routing.policy,
        "--service-discovery",
        "--selector",
        *selector,
        "--service-discovery-port",
        str(SERVER_PORT),
        "--service-discovery-namespace",
        im.namespace,
        "--health-check-endpoint",
        "/ready",
        "--retry-max-retries",
        str(ROUTER_RETRIES),
        "--prometheus-host",
        "0.0.0.0",
        "--prometheus-port",
        str(ROUTER_METRICS_PORT),
    ]


def render_router_serviceaccount(im: InferenceModel) -> Manifest:
    return api_service_account(_router_metadata(im))  # the router lists pods through the API


def render_router_role(im: InferenceModel) -> Manifest:
    return role(
        _router_metadata(im), [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    )


def render_router_rolebinding(im: InferenceModel) -> Manifest:
    return own_role_binding(_router_metadata(im))


def render_router_deployment(im: InferenceModel, defaults: ClusterDefaults | None = None) -> Manifest:
    defaults = defaults or ClusterDefaults()
    routing = im.spec.routing
    res = {"cpu": str(routing.resources.cpu), "memory": str(routing.resources.memory)}
    container: dict[str, Any] = {
        "name": "router",
        "image": routing.image or defaults.router_image,
        "args": router_args(im),
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/readiness", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/liveness", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {"requests": dict(res), "limits": dict(res)},
        "securityContext": restricted_container_security_context(),
    }
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_metadata(im),
        "spec": {
            "replicas": routing.replicas,
            "selector": {"matchLabels": router_selector_labels(im)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {**labels(im), **router_selector_labels(im)}},
                "spec": {
                    "serviceAccountName": router_name(im),
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    # Spread router replicas so one node's loss does not take routing down.
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": router_selector_labels(im)},
                        }
                    ],
                },
            },
        },
    }
    pull_secrets = defaults.pull_secrets([])
    if pull_secrets:
        out["spec"]["template"]["spec"]["imagePullSecrets"] = pull_secrets
    return out


def render_router_service(im: InferenceModel) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_metadata(im),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(im),
            "ports": [
                {"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def render_router_pdb(im: InferenceModel) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _router_metadata(im),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector_labels(im)}},
    }


def render_router_servicemonitor(im: InferenceModel) -> Manifest:
    sm = im.spec.monitoring.service_monitor
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _router_metadata(im, extra_labels=sm.labels),
        "spec": {
            "selector": {"matchLabels": router_selector_labels(im)},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": sm.interval}],
        },
    }


def render_router(
    im: InferenceModel, service_monitor: bool = True, defaults: ClusterDefaults | None = None
) -> list[Manifest]:
    """Every router object, in apply order (RBAC before the pods that need it); [] when routing is off.
    service_monitor: whether the ServiceMonitor CRD is installed and monitoring is enabled."""
    if not wants_router(im):
        return []
    objects = [
        render_router_serviceaccount(im),
        render_router_role(im),
        render_router_rolebinding(im),
        render_router_service(im),
    ]
    if im.spec.routing.replicas > 1:
        objects.append(render_router_pdb(im))
    objects.append(render_router_deployment(im, defaults))
    if service_monitor:
        objects.append(render_router_servicemonitor(im))
    return objects
