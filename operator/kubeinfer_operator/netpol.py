"""NetworkPolicies for a model's pods and its router (spec.network): each admits what its pods need
and nothing else.

Ingress:
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

Egress (the model's pods only; issue 45 item 1: a leaked credential has less room): DNS to the
cluster's DNS pods; TCP 443 to any address but the link-local range (cloud metadata services)
only when the spec names a hub source (hf:// model, draft or adapter: the hub and its CDN have no
fixed addresses, and a NetworkPolicy cannot name hosts) or an s3:// model (its store, HTTPS; the
cache loader downloads it); with several nodes, every port of the
model's own pods. No API server: the pods mount no ServiceAccount token. A pvc:// or in-image
model gets no internet egress. The router (pod discovery) and the activator (scale-up) need the API
server and keep the namespace's egress.

Peers outside the namespace are chosen by namespace name (`kubernetes.io/metadata.name`, which the
API server sets) and pod labels: the operator's pods in the operator's namespace (the chart's
POD_NAMESPACE, else the namespace of the operator's own ServiceAccount; outside a cluster: no peer),
Prometheus in the monitoring namespace.

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


# The cluster DNS pods: kube-dns and CoreDNS both carry k8s-app=kube-dns in kube-system (kubeadm,
# GKE, EKS, AKS).
DNS_NAMESPACE = "kube-system"
DNS_POD_LABELS = (("k8s-app", "kube-dns"),)
DNS_PORT = 53
HTTPS_PORT = 443
# Cloud metadata services hand out node credentials: link-local 169.254.169.254, EC2's fd00:ec2::254.
ANY_IPV4, ANY_IPV6 = "0.0.0.0/0", "::/0"
METADATA_EXCEPT_V4, METADATA_EXCEPT_V6 = ("169.254.0.0/16",), ("fe80::/10", "fd00:ec2::254/128")
# The in-cluster ServiceAccount's namespace file: where the operator runs when the chart's
# POD_NAMESPACE is not set.
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _in_namespace(namespace: str, pod_labels: tuple[tuple[str, str], ...]) -> Peer:
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
        "podSelector": {"matchLabels": dict(pod_labels)},
    }


def operator_namespace(
    defaults: ClusterDefaults, sa_file: str = SERVICE_ACCOUNT_NAMESPACE_FILE
) -> str | None:
    """The operator's namespace: the chart's POD_NAMESPACE, else its ServiceAccount's; None outside a
    cluster (no pod peer: a label in any namespace would admit any pod that copies it)."""
    if defaults.operator_namespace:
        return defaults.operator_namespace
    try:
        with open(sa_file, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def client_peers(im: InferenceModel) -> list[Peer]:
    """spec.network.allowedClients as given, or every pod of the model's namespace."""
    return [p.to_dict() for p in im.spec.network.allowed_clients] or [{"podSelector": {}}]


def operator_peers(defaults: ClusterDefaults) -> list[Peer]:
    namespace = operator_namespace(defaults)
    return [_in_namespace(namespace, defaults.operator_pod_labels)] if namespace else []


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
    api_from = [*client_peers(im), *operator_peers(defaults), prometheus_peer(defaults)]
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
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": model_egress(im),
        },
    }


def hub_sources(im: InferenceModel) -> list[str]:
    """The spec's hf:// sources (model, draft, adapters): the pods (or the cache loader) download them."""
    spec = im.spec
    draft = spec.engine.speculative.model if spec.engine.speculative is not None else None
    uris = [spec.model.uri, draft, *(a.uri for a in spec.adapters)]
    return [u for u in uris if u and u.startswith("hf://")]


def model_egress(im: InferenceModel) -> list[dict[str, Any]]:
    """Where the model's pods (and its cache loader, which carries the same labels) may connect."""
    dns = _in_namespace(DNS_NAMESPACE, DNS_POD_LABELS)
    egress: list[dict[str, Any]] = [
        {"to": [dns], "ports": [{"protocol": p, "port": DNS_PORT} for p in ("UDP", "TCP")]}
    ]
    # An s3:// model's store: HTTPS like the hub (AWS, R2, GCS's XML API, a MinIO behind TLS). A store
    # on another port needs one more, additive NetworkPolicy from the namespace's owner.
    if hub_sources(im) or im.spec.model.uri.startswith("s3://"):
        hosts = [
            {"ipBlock": {"cidr": ANY_IPV4, "except": list(METADATA_EXCEPT_V4)}},
            {"ipBlock": {"cidr": ANY_IPV6, "except": list(METADATA_EXCEPT_V6)}},
        ]
        egress.append({"to": hosts, "ports": _tcp(HTTPS_PORT)})
    if multi_node(im):
        egress.append({"to": [{"podSelector": {"matchLabels": selector_labels(im)}}]})
    return egress


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
