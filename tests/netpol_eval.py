"""NetworkPolicy semantics (networking.k8s.io/v1, as https://kubernetes.io/docs/concepts/services-networking/network-policies/
defines them) over pods given by namespace and labels: whether a connection from one pod to a port
of another is admitted. Shared by the operator's and the chart's policy tests; ipBlock peers match no
pod (they select addresses, which these tests do not model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    namespace_labels: dict[str, str] = field(default_factory=dict)

    @property
    def ns_labels(self) -> dict[str, str]:
        # the API server labels every namespace with its name
        return {**self.namespace_labels, NAMESPACE_NAME_LABEL: self.namespace}


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """metav1.LabelSelector: every matchLabels pair and every matchExpressions requirement holds
    ({} matches everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_ns: str, pod: Pod) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], pod.ns_labels):
            return False
    elif pod.namespace != policy_ns:
        return False
    return selector_matches(peer.get("podSelector") or {}, pod.labels)


def _port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        start, end = p["port"], p.get("endPort", p["port"])
        assert isinstance(start, int), "named ports are not modelled: render numbers"
        if start <= port <= end:
            return True
    return False


def _selects(policy: dict[str, Any], pod: Pod, direction: str) -> bool:
    meta, spec = policy["metadata"], policy["spec"]
    types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
    return (
        meta.get("namespace") == pod.namespace
        and direction in types
        and selector_matches(spec.get("podSelector") or {}, pod.labels)
    )


def _direction_admits(
    policies: list[dict[str, Any]], subject: Pod, other: Pod, port: int, protocol: str, direction: str
) -> bool:
    selecting = [p for p in policies if _selects(p, subject, direction)]
    if not selecting:
        return True  # not isolated in this direction
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in selecting:
        ns = policy["metadata"]["namespace"]
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if _port_matches(rule.get("ports"), port, protocol) and (
                not peers or any(_peer_matches(peer, ns, other) for peer in peers)
            ):
                return True
    return False


def admits(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether `src` may open a connection to `port` of `dst`: the destination's ingress and the
    source's egress must both allow it."""
    return _direction_admits(policies, dst, src, port, protocol, "Ingress") and _direction_admits(
        policies, src, dst, port, protocol, "Egress"
    )
