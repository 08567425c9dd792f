"""NetworkPolicies for a model's pods and its router (spec.network): each admits what its pods need
and nothing else. Ingress only: the pods' own egress (hub downloads, DNS) stays as the namespace has it.

- `<child name>` (every pod of the model): the API port (8080) from the clients (spec.network.
  allowedClients, default the model's namespace), the model's router, the operator (adapter sync)
  and Prometheus (/metrics); with routing, the KV-event ports from the router only; with several
  nodes per replica, every port from the model's own pods (torch's rendezvous port and the
  ephemeral ports gloo/NCCL open between ranks: one policy cannot tell a group from another group
  of the same model, so the ranks of all its groups may connect).
- `<name>-router` (with routing): the router's port from the clients, its metrics port from
  Prometheus.
- `<child>-epp` (spec.routing.gateway): the endpoint picker's ext-proc port from the Gateway's namespace
  (gatewayRef; without one, from the clients), its metrics port from Prometheus; the model's policy
  admits the picker (it scrapes /metrics on the API port) and the Gateway's namespace (its proxies
  forward to the pods) on the API port.
- `<name>-activator` (scale to zero, `scaling.minReplicas: 0`): its port (requests and /activator/metrics)
  from the clients and Prometheus; the activator in turn reaches the router's port (with routing) or
  the model's API port (without), so each of those admits it.

The kubelet's probes need no rule (NetworkPolicy never blocks a node's traffic to its pods).
spec.network.networkPolicy false renders none (and deletes the ones it rendered before).
"""

from __future__ import annotations

from typing import Any

from .common import SERVER_PORT, ChildRef, Manifest, child_metadata, selector_labels
from .defaults import ClusterDefaults
from .gateway import (
    EPP_GRPC_PORT,
    EPP_METRICS_PORT,
    epp_metadata,
    epp_name,
    epp_selector_labels,
    wants_gateway,
)
from .render_activator import (
    ACTIVATOR_PORT,
    _meta,
    activator_name,
    activator_selector_labels,
    wants_activator,
)
from .routing import (
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    ROUTER_METRICS_PORT,
    ROUTER_PORT,
    _router_metadata,
    router_name,
    router_selector_labels,
    wants_router,
)
from .spec import InferenceModel
from .workload import multi_node

KIND = "NetworkPolicy"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace

Peer = dict[str, Any]


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _in_namespace(namespace: str | None, pod_labels: tuple[tuple[str, str], ...]) -> Peer:
    ns_selector: dict[str, Any] = {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}} if namespace else {}
    return {"namespaceSelector": ns_selector, "podSelector": {"matchLabels": dict(pod_labels)}}


def client_peers(im: InferenceModel) -> list[Peer]:
    """spec.network.allowedClients as given, or every pod of the model's namespace."""
    return [p.to_dict() for p in im.spec.network.allowed_clients] or [{"podSelector": {}}]


def operator_peer(defaults: ClusterDefaults) -> Peer:
    return _in_namespace(defaults.operator_namespace, defaults.operator_pod_labels)


def prometheus_peer(defaults: ClusterDefaults) -> Peer:
    return _in_namespace(defaults.monitoring_namespace, defaults.prometheus_pod_labels)


def router_peer(im: InferenceModel) -> Peer:
    return {"podSelector": {"matchLabels": router_selector_labels(im)}}


def activator_peer(im: InferenceModel) -> Peer:
    return {"podSelector": {"matchLabels": activator_selector_labels(im)}}


def gateway_peers(im: InferenceModel) -> list[Peer]:
    """The pods of the Gateway that routes to the model's pool: every pod of the gatewayRef's namespace
    (the proxies' labels belong to the Gateway's implementation); none without a gatewayRef (the
    clients' peers must then include the Gateway's)."""
    ref = im.spec.routing.gateway.gateway_ref
    if ref is None:
        return []
    return [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ref.namespace or im.namespace}}}]


def epp_peer(im: InferenceModel) -> Peer:
    return {"podSelector": {"matchLabels": epp_selector_labels(im)}}


def render_model_policy(
    im: InferenceModel, defaults: ClusterDefaults, gateway_served: bool = True
) -> Manifest:
    api_from = [*client_peers(im), operator_peer(defaults), prometheus_peer(defaults)]
    if wants_gateway(im) and gateway_served:
        api_from += [epp_peer(im), *gateway_peers(im)]
    if wants_router(im):
        api_from.append(router_peer(im))
    elif wants_activator(im):
        api_from.append(activator_peer(im))
    ingress: list[dict[str, Any]] = [{"from": api_from, "ports": _tcp(SERVER_PORT)}]
    if wants_router(im):
        ingress.append({"from": [router_peer(im)], "ports": _tcp(KV_EVENTS_PORT, KV_REPLAY_PORT)})
    if multi_node(im):
        # the rendezvous port (DIST_PORT) and every ephemeral port between ranks
        ingress.append({"from": [{"podSelector": {"matchLabels": selector_labels(im)}}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": KIND,
        "metadata": child_metadata(im),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(im)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def render_router_policy(im: InferenceModel, defaults: ClusterDefaults) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": KIND,
        "metadata": _router_metadata(im),
        "spec": {
            "podSelector": {"matchLabels": router_selector_labels(im)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [*client_peers(im), *([activator_peer(im)] if wants_activator(im) else [])],
                    "ports": _tcp(ROUTER_PORT),
                },
                {"from": [prometheus_peer(defaults)], "ports": _tcp(ROUTER_METRICS_PORT)},
            ],
        },
    }


def render_activator_policy(im: InferenceModel, defaults: ClusterDefaults) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": KIND,
        "metadata": _meta(im),
        "spec": {
            "podSelector": {"matchLabels": activator_selector_labels(im)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [*client_peers(im), prometheus_peer(defaults)], "ports": _tcp(ACTIVATOR_PORT)},
            ],
        },
    }


def render_epp_policy(im: InferenceModel, defaults: ClusterDefaults) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": KIND,
        "metadata": epp_metadata(im),
        "spec": {
            "podSelector": {"matchLabels": epp_selector_labels(im)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": gateway_peers(im) or client_peers(im), "ports": _tcp(EPP_GRPC_PORT)},
                {"from": [prometheus_peer(defaults)], "ports": _tcp(EPP_METRICS_PORT)},
            ],
        },
    }


def network_policies(
    im: InferenceModel, defaults: ClusterDefaults | None = None, gateway_served: bool = True
) -> tuple[list[Manifest], list[ChildRef]]:
    """The NetworkPolicies the spec wants, and the ones that may exist but must not. `gateway_served`:
    whether the InferencePool kind is served (else no endpoint picker runs, and no policy admits one)."""
    defaults = defaults or ClusterDefaults()
    possible = [ChildRef(KIND, n) for n in (im.child_name, router_name(im), activator_name(im), epp_name(im))]
    if not im.spec.network.network_policy:
        return [], possible
    objects = [render_model_policy(im, defaults, gateway_served)]
    if wants_router(im):
        objects.append(render_router_policy(im, defaults))
    if wants_activator(im):
        objects.append(render_activator_policy(im, defaults))
    if wants_gateway(im) and gateway_served:
        objects.append(render_epp_policy(im, defaults))
    present = {ChildRef(KIND, o["metadata"]["name"]) for o in objects}
    return objects, [r for r in possible if r not in present]
