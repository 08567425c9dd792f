"""NetworkPolicies as a real kube-apiserver v1.36.2 judged them (issue 48): the model's policy as the
operator rendered it for examples/gateway.yaml (ingress from clients, the operator, Prometheus, the
endpoint picker and the Gateway's namespace; egress to DNS and to 443 outside the link-local ranges),
then one field broken per case, each applied server-side (dry run). kmock must refuse what the real
server refused, naming the same field, and accept what it accepted."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from op_apichecks import api_errors
from op_cluster import BASE_RESOURCES, PATHS, MockCluster

NS = "default"
_OPERATOR = {"app.kubernetes.io/component": "operator", "app.kubernetes.io/name": "kubeinfer"}
POLICY: dict[str, Any] = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "np", "namespace": NS},
    "spec": {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/instance": "m", "app.kubernetes.io/name": "kubeinfer-server"}
        },
        "ingress": [
            {
                "ports": [{"protocol": "TCP", "port": 8080}],
                "from": [
                    {"podSelector": {}},
                    {
                        "podSelector": {"matchLabels": _OPERATOR},
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "kubeinfer-system"}
                        },
                    },
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}},
                ],
            }
        ],
        "egress": [
            {
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                "to": [
                    {
                        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    }
                ],
            },
            {
                "ports": [{"protocol": "TCP", "port": 443}],
                "to": [
                    {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}},
                    {"ipBlock": {"cidr": "::/0", "except": ["fe80::/10", "fd00:ec2::254/128"]}},
                ],
            },
        ],
        "policyTypes": ["Ingress", "Egress"],
    },
}


def _with(change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    obj = copy.deepcopy(POLICY)
    change(obj["spec"])
    return obj


def _block(**fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s["egress"][1]["to"][0]["ipBlock"].update(fields)


def _port(**fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s["egress"][1]["ports"][0].update(fields)


# (case, object, None if accepted else the start of the real server's field error)
CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("rendered", POLICY, None),
    (
        "cidr-33",
        _with(_block(cidr="0.0.0.0/33")),
        'spec.egress[1].to[0].ipBlock.cidr: Invalid value: "0.0.0.0/33": must be a valid CIDR',
    ),
    (
        "cidr-host-bits",
        _with(_block(cidr="10.0.0.1/8", **{"except": ["10.1.0.0/16"]})),
        'spec.egress[1].to[0].ipBlock.cidr: Invalid value: "10.0.0.1/8": must not have bits set beyond the prefix length',
    ),
    (
        "except-outside",
        _with(_block(cidr="10.0.0.0/8", **{"except": ["192.168.0.0/16"]})),
        'spec.egress[1].to[0].ipBlock.except[0]: Invalid value: "192.168.0.0/16": must be a strict subset of `cidr`',
    ),
    (
        "except-equal",
        _with(_block(cidr="10.0.0.0/8", **{"except": ["10.0.0.0/8"]})),
        'spec.egress[1].to[0].ipBlock.except[0]: Invalid value: "10.0.0.0/8": must be a strict subset of `cidr`',
    ),
    (
        "except-v6-in-v4",
        _with(_block(**{"except": ["fe80::/10"]})),
        'spec.egress[1].to[0].ipBlock.except[0]: Invalid value: "fe80::/10": must be a strict subset of `cidr`',
    ),
    (
        "port-0",
        _with(_port(port=0)),
        "spec.egress[1].ports[0].port: Invalid value: 0: must be between 1 and 65535",
    ),
    (
        "port-65536",
        _with(_port(port=65536)),
        "spec.egress[1].ports[0].port: Invalid value: 65536: must be between 1 and 65535",
    ),
    (
        "endport-below",
        _with(_port(port=443, endPort=400)),
        "spec.egress[1].ports[0].endPort: Invalid value: 443: must be greater than or equal to `port`",
    ),
    (
        "endport-named",
        _with(_port(port="https", endPort=500)),
        "spec.egress[1].ports[0].endPort: Invalid value: 500: may not be specified when `port` is non-numeric",
    ),
    ("endport-ok", _with(_port(port=443, endPort=8443)), None),
    (
        "protocol-icmp",
        _with(_port(protocol="ICMP")),
        'spec.egress[1].ports[0].protocol: Unsupported value: "ICMP"',
    ),
    (
        "named-port-bad",
        _with(_port(port="Bad_Name")),
        'spec.egress[1].ports[0].port: Invalid value: "Bad_Name"',
    ),
    (
        "policytype-bad",
        _with(lambda s: s.update(policyTypes=["Ingress", "Foo"])),
        'spec.policyTypes[1]: Unsupported value: "Foo"',
    ),
    (
        "peer-ipblock-and-pods",
        _with(lambda s: s["egress"][1]["to"][0].update(podSelector={})),
        "spec.egress[1].to[0]: Forbidden: may not specify both ipBlock and another peer",
    ),
    (
        "peer-empty",
        _with(lambda s: s["egress"][1]["to"].append({})),
        "spec.egress[1].to[2]: Required value: must specify a peer",
    ),
    (
        "matchexpr-bad-op",
        _with(
            lambda s: s["podSelector"].update(
                matchExpressions=[{"key": "a", "operator": "Equals", "values": ["b"]}]
            )
        ),
        'spec.podSelector.matchExpressions[0].operator: Invalid value: "Equals": not a valid selector operator',
    ),
]
IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("case", "obj", "real"), CASES, ids=IDS)
def test_the_checker_refuses_what_the_api_server_refused(
    case: str, obj: dict[str, Any], real: str | None
) -> None:
    errors = api_errors(copy.deepcopy(obj))
    if real is None:
        assert errors == [], case
    else:
        assert any(e.startswith(real) for e in errors), (case, errors)


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster(resources=dict(BASE_RESOURCES)).start()
    yield mock
    mock.stop()


@pytest.mark.parametrize(("case", "obj", "real"), CASES, ids=IDS)
def test_kmock_answers_a_server_side_apply_as_the_api_server_did(
    cluster: MockCluster, case: str, obj: dict[str, Any], real: str | None
) -> None:
    path = f"{PATHS['NetworkPolicy'].format(ns=NS)}/np?fieldManager=test&force=true"
    req = urllib.request.Request(cluster.url + path, data=json.dumps(obj).encode(), method="PATCH")
    req.add_header("Content-Type", "application/apply-patch+yaml")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, message = resp.status, ""
    except urllib.error.HTTPError as exc:
        status, message = exc.code, str(json.loads(exc.read()).get("message"))
    if real is None:
        assert status in (200, 201), (case, status, message)
    else:
        assert status == 422 and real in message, (case, status, message)
