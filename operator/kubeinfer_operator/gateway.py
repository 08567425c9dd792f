"""Pure renderers for `spec.routing.gateway`: the Gateway API Inference Extension in front of a model.

- An `InferencePool` (inference.networking.k8s.io/v1, the extension's GA API) named after the model,
  selecting the pods that serve the API (serving_selector_labels: the group leaders of a multi-node
  model) on the API port, with `endpointPickerRef` to the model's endpoint picker Service.
- The endpoint picker (EPP): a Deployment `<child>-epp` running the extension's picker (`--pool-name`,
  `--pool-namespace`; ext-proc gRPC on 9002, gRPC health on 9003, Prometheus metrics on 9090), its
  Service, and a ServiceAccount with a Role that reads the pool and the namespace's pods (what the
  extension's manifests grant it, less the cluster-wide tokenreviews/subjectaccessreviews its metrics
  authentication needs: that is off, `--metrics-endpoint-auth=false`, and the metrics port admits only
  Prometheus). The picker scrapes each pod's /metrics for the model server protocol's
  vLLM names (vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc,
  vllm:lora_requests_info, vllm:cache_config_info: tests/api checks ours), so the model's NetworkPolicy
  admits it on the API port.
- With `gatewayRef`, an `HTTPRoute` (gateway.networking.k8s.io/v1) from that Gateway to the pool.
- With `priority`, an `InferenceObjective` (inference.networking.x-k8s.io/v1alpha2, the extension's
  per-objective priority) named after the pool, referring to it. The two orders are opposite: the
  server's request `priority` (vLLM's, --scheduling-policy priority) serves lower values first, the
  objective's higher ones ("Priority 10 will always be served before 0"), so the objective gets the
  spec's value negated: a request sent with the header `x-gateway-inference-objective: <pool>` and the
  body `priority: <spec value>` is ordered alike by the picker's flow control and the server's queue.

A cluster without the extension's CRD still gets a serving model: the pool, picker and route are left
out and status says `GatewayAvailable=False` (reason CRDNotInstalled), as with KEDA; they appear once
the CRD does (the operator watches CRDs). Who chooses between this and spec.routing (vllm-router):
docs/operator.md, "Gateway API Inference Extension".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .canary import canary_view, canary_view_name, canary_weight
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

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"
POOL_PLURAL = "inferencepools"
POOL_CRD_NAME = f"{POOL_PLURAL}.inference.networking.k8s.io"
ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
ROUTE_KIND = "HTTPRoute"
ROUTE_CRD_NAME = "httproutes.gateway.networking.k8s.io"
OBJECTIVE_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
OBJECTIVE_KIND = "InferenceObjective"
OBJECTIVE_CRD_NAME = "inferenceobjectives.inference.networking.x-k8s.io"
# The request header the picker selects an objective by (the extension's).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
# The gRPC health service name the extension's picker answers on its health port.
EPP_HEALTH_SERVICE = "inference-extension"
# The picker's kinds in apply order (RBAC and Service before its pods), all named epp_name.
EPP_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment")


def wants_gateway(im: InferenceModel) -> bool:
    return im.spec.routing.gateway.enabled


def pool_name(im: InferenceModel) -> str:
    return im.child_name


def epp_name(im: InferenceModel) -> str:
    return derived_name(im.child_name, "epp")


def epp_selector_labels(im: InferenceModel) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kubeinfer-endpoint-picker",
        "app.kubernetes.io/instance": im.child_name,
    }


def _meta(
    im: InferenceModel, name: str, component: str, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": im.namespace,
        "labels": {**labels(im), **(extra or {}), "app.kubernetes.io/component": component},
    }
    if im.uid is not None:
        meta["ownerReferences"] = [owner_reference(im)]
    return meta


def epp_metadata(im: InferenceModel) -> dict[str, Any]:
    return _meta(im, epp_name(im), "endpoint-picker", epp_selector_labels(im))


def render_inference_pool(im: InferenceModel) -> Manifest:
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": POOL_KIND,
        "metadata": _meta(im, pool_name(im), "inference-pool"),
        "spec": {
            "selector": {"matchLabels": serving_selector_labels(im)},
            "targetPorts": [{"number": SERVER_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_name(im),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": im.spec.routing.gateway.endpoint_picker.failure_mode,
            },
        },
    }


def render_inference_objective(im: InferenceModel) -> Manifest | None:
    """The model's InferenceObjective (None without spec.routing.gateway.priority); its priority is the
    spec's negated (the module docstring says why)."""
    priority = im.spec.routing.gateway.priority
    if priority is None:
        return None
    return {
        "apiVersion": OBJECTIVE_API_VERSION,
        "kind": OBJECTIVE_KIND,
        "metadata": _meta(im, pool_name(im), "inference-objective"),
        "spec": {
            "poolRef": {"group": "inference.networking.k8s.io", "kind": POOL_KIND, "name": pool_name(im)},
            "priority": -priority,
        },
    }


def gateway_server_args(im: InferenceModel) -> list[str]:
    """The server's flags from spec.routing.gateway.priority: priority scheduling, and the objective the
    picker selects by the header mapped to the spec's priority (server/api/objectives.py), so a request
    the gateway ordered by its objective is queued alike without a `priority` in its body."""
    gateway = im.spec.routing.gateway
    if not gateway.enabled or gateway.priority is None:
        return []
    return ["--scheduling-policy", "priority", "--objective-priority", f"{pool_name(im)}={gateway.priority}"]


def render_epp_serviceaccount(im: InferenceModel) -> Manifest:
    return api_service_account(epp_metadata(im))  # the picker watches its pool and the pods through the API


# What the picker reads (the extension's manifests): its pool, the pods it picks from, and the
# alpha objectives and rewrites where their CRDs exist. Read-only; the operator holds the same rules.
EPP_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
]


def render_epp_role(im: InferenceModel) -> Manifest:
    return role(epp_metadata(im), EPP_RULES)


def render_epp_rolebinding(im: InferenceModel) -> Manifest:
    return own_role_binding(epp_metadata(im))


def render_epp_service(im: InferenceModel) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": epp_metadata(im),
        "spec": {
            "type": "ClusterIP",
            "selector": epp_selector_labels(im),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": EPP_GRPC_PORT,
                    "targetPort": "grpc-ext-proc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def epp_args(im: InferenceModel) -> list[str]:
    return [
        "--pool-name",
        pool_name(im),
        "--pool-namespace",
        im.namespace,
        "--pool-group",
        "inference.networking.k8s.io",
        "--grpc-port",
        str(EPP_GRPC_PORT),
        "--grpc-health-port",
        str(EPP_HEALTH_PORT),
        "--zap-encoder",
        "json",
        # The picker's default checks a scraper's token with TokenReview/SubjectAccessReview, which needs
        # a cluster-scoped binding per picker; its metrics port is fenced to Prometheus by the model's
        # NetworkPolicy instead, as the model server's /metrics is (netpol.py).
        "--metrics-endpoint-auth=false",
    ]


def render_epp_deployment(im: InferenceModel, defaults: ClusterDefaults | None = None) -> Manifest:
    defaults = defaults or ClusterDefaults()
    epp = im.spec.routing.gateway.endpoint_picker
    probe = {"grpc": {"port": EPP_HEALTH_PORT, "service": EPP_HEALTH_SERVICE}, "periodSeconds": 10}
    container: dict[str, Any] = {
        "name": "epp",
        "image": epp.image or defaults.endpoint_picker_image,
        "args": epp_args(im),
        "ports": [
            {"name": "grpc-ext-proc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {**probe, "initialDelaySeconds": 5},
        "livenessProbe": {**probe, "initialDelaySeconds": 5},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": restricted_container_security_context(),
    }
    out: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": epp_metadata(im),
        "spec": {
            "replicas": epp.replicas,
            "selector": {"matchLabels": epp_selector_labels(im)},
            "template": {
                "metadata": {"labels": {**labels(im), **epp_selector_labels(im)}},
                "spec": {
                    "serviceAccountName": epp_name(im),
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    # As the extension advises: at least the longest grace period of the pool's pods.
                    "terminationGracePeriodSeconds": 130,
                },
            },
        },
    }
    pull_secrets = defaults.pull_secrets([])
    if pull_secrets:
        out["spec"]["template"]["spec"]["imagePullSecrets"] = pull_secrets
    return out


def render_http_route(im: InferenceModel) -> Manifest | None:
    ref = im.spec.routing.gateway.gateway_ref
    if ref is None:
        return None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": ref.name}
    if ref.namespace is not None:
        parent["namespace"] = ref.namespace
    return {
        "apiVersion": ROUTE_API_VERSION,
        "kind": ROUTE_KIND,
        "metadata": _meta(im, pool_name(im), "http-route"),
        "spec": {
            "parentRefs": [parent],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": route_backends(im),
                }
            ],
        },
    }


def route_backends(im: InferenceModel) -> list[dict[str, Any]]:
    """The HTTPRoute's backendRefs: the model's pool, and with spec.canary the canary's pool beside it,
    weighted `100 - weight` and `weight` (the Gateway API's weights are proportions of their sum, and a
    weight of 0 gets no request)."""
    pool = {"group": "inference.networking.k8s.io", "kind": POOL_KIND}
    if im.spec.canary is None:
        return [{**pool, "name": pool_name(im)}]
    weight = canary_weight(im)
    return [
        {**pool, "name": pool_name(im), "weight": 100 - weight},
        {**pool, "name": canary_view_name(im), "weight": weight},
    ]


def render_gateway(
    im: InferenceModel,
    pool_served: bool,
    route_served: bool,
    defaults: ClusterDefaults | None = None,
    objective_served: bool = True,
) -> list[Manifest]:
    """Every gateway object in apply order; [] when spec.routing.gateway is off or the InferencePool
    kind is not served (then nothing routes to the picker, so it is left out too). The HTTPRoute and
    the InferenceObjective need their own CRDs (the Gateway API's, the extension's alpha one) as well."""
    if not (wants_gateway(im) and pool_served):
        return []
    objects = [
        render_epp_serviceaccount(im),
        render_epp_role(im),
        render_epp_rolebinding(im),
        render_epp_service(im),
        render_epp_deployment(im, defaults),
        render_inference_pool(im),
    ]
    route = render_http_route(im) if im.variant == "stable" else None  # the stable's route weighs both
    if route is not None and route_served:
        objects.append(route)
    objective = render_inference_objective(im)
    if objective is not None and objective_served:
        objects.append(objective)
    canary = canary_view(im)
    if canary is not None:
        # The canary's pool and picker before the route that sends it traffic.
        at = (
            len(objects) - (route is not None and route_served) - (objective is not None and objective_served)
        )
        objects[at:at] = render_gateway(canary, pool_served, route_served, defaults, objective_served)
    return objects


@dataclass(frozen=True)
class GatewaySkip:
    """Why spec.routing.gateway's objects are not (all) rendered: the condition's reason and message."""

    reason: str  # "NotEnabled" (the installation's inferenceExtension.enabled) | "CRDNotInstalled"
    message: str


def gateway_skipped(
    im: InferenceModel,
    pool_served: bool,
    route_served: bool,
    enabled: bool = True,
    objective_served: bool = True,
) -> GatewaySkip | None:
    """None when every object the spec's gateway wants is rendered."""
    if not wants_gateway(im):
        return None
    if not enabled:
        return GatewaySkip(
            "NotEnabled",
            "this kubeinfer installation does not render Inference Extension objects (chart value "
            "inferenceExtension.enabled)",
        )
    if not pool_served:
        return GatewaySkip("CRDNotInstalled", f"{POOL_API_VERSION} {POOL_KIND} is not served by this cluster")
    if im.spec.routing.gateway.gateway_ref is not None and not route_served:
        return GatewaySkip(
            "CRDNotInstalled", f"{ROUTE_API_VERSION} {ROUTE_KIND} is not served by this cluster"
        )
    if im.spec.routing.gateway.priority is not None and not objective_served:
        return GatewaySkip(
            "CRDNotInstalled", f"{OBJECTIVE_API_VERSION} {OBJECTIVE_KIND} is not served by this cluster"
        )
    return None
