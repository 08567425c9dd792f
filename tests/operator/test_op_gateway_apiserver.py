"""InferencePools and HTTPRoutes as a real kube-apiserver v1.36.2 judged them (issue 48), with the
extension's v1.6.0 InferencePool CRD and the Gateway API's v1.6.1 standard HTTPRoute CRD installed from
their published manifests: each case was applied server-side (dry run) and its verdict is recorded
below with the field the server named. The checker (op_gatewaychecks) and kmock must answer the same:
kmock refuses what the real server refuses, and accepts what it accepts."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from op_apichecks import gateway_api_errors
from op_cluster import BASE_RESOURCES, INFERENCE_EXTENSION, PATHS, MockCluster

NS = "default"
POOL: dict[str, Any] = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "p", "namespace": NS},
    "spec": {
        "selector": {"matchLabels": {"app": "m"}},
        "targetPorts": [{"number": 8080}],
        "endpointPickerRef": {
            "kind": "Service",
            "name": "p-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    },
}
POOL_REF = {"group": "inference.networking.k8s.io", "kind": "InferencePool"}
ROUTE: dict[str, Any] = {
    "apiVersion": "gateway.networking.k8s.io/v1",
    "kind": "HTTPRoute",
    "metadata": {"name": "r", "namespace": NS},
    "spec": {
        "parentRefs": [
            {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw", "namespace": "gws"}
        ],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{**POOL_REF, "name": "p"}],
            }
        ],
    },
}


def _with(base: dict[str, Any], change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    change(obj["spec"])
    return obj


def _epp(**fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s["endpointPickerRef"].update(fields)


def _backend(**fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s["rules"][0]["backendRefs"][0].update(fields)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s.update({key: value})


def _rule(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s["rules"][0].update({key: value})


# (case, object, the real server's answer to a server-side apply: None accepted, else (HTTP status,
# the start of its field error))
CASES: list[tuple[str, dict[str, Any], tuple[int, str] | None]] = [
    ("pool-ok", POOL, None),
    ("pool-no-selector", _with(POOL, lambda s: s.pop("selector")), (422, "spec.selector: Required value")),
    (
        "pool-empty-matchlabels",
        _with(POOL, lambda s: s["selector"].update(matchLabels={})),
        (422, "spec.selector.matchLabels: Invalid value: 0"),
    ),
    (
        "pool-65-labels",
        _with(POOL, lambda s: s["selector"].update(matchLabels={f"k{i}": "v" for i in range(65)})),
        (422, "spec.selector.matchLabels: Too many: 65: must have at most 64 items"),
    ),
    (
        "pool-label-value-64",
        _with(POOL, lambda s: s["selector"].update(matchLabels={"app": "a" * 64})),
        (422, "spec.selector.matchLabels.app: Too long: may not be more than 63 bytes"),
    ),
    (
        "pool-label-value-bad",
        _with(POOL, lambda s: s["selector"].update(matchLabels={"app": "-bad-"})),
        (422, 'spec.selector.matchLabels.app: Invalid value: "-bad-"'),
    ),
    # The CRD checks label values only: a key a Pod could never carry is accepted.
    ("pool-label-key-bad", _with(POOL, lambda s: s["selector"].update(matchLabels={"bad key": "v"})), None),
    ("pool-no-ports", _with(POOL, _set("targetPorts", [])), (422, "spec.targetPorts: Invalid value: 0")),
    (
        "pool-9-ports",
        _with(POOL, _set("targetPorts", [{"number": 8000 + i} for i in range(9)])),
        (422, "spec.targetPorts: Too many: 9: must have at most 8 items"),
    ),
    (
        "pool-dup-ports",
        _with(POOL, _set("targetPorts", [{"number": 8080}, {"number": 8080}])),
        (422, "spec.targetPorts: Invalid value: port number must be unique"),
    ),
    (
        "pool-port-0",
        _with(POOL, _set("targetPorts", [{"number": 0}])),
        (422, "spec.targetPorts[0].number: Invalid value: 0"),
    ),
    (
        "pool-port-65536",
        _with(POOL, _set("targetPorts", [{"number": 65536}])),
        (422, "spec.targetPorts[0].number: Invalid value: 65536"),
    ),
    (
        "pool-bad-appprotocol",
        _with(POOL, _set("appProtocol", "grpc")),
        (422, 'spec.appProtocol: Unsupported value: "grpc"'),
    ),
    ("pool-h2c", _with(POOL, _set("appProtocol", "kubernetes.io/h2c")), None),
    (
        "pool-epp-no-port",
        _with(POOL, lambda s: s["endpointPickerRef"].pop("port")),
        (
            422,
            "spec.endpointPickerRef: Invalid value: port is required when kind is 'Service' or unspecified",
        ),
    ),
    (
        "pool-epp-other-kind-no-port",
        _with(
            POOL, lambda s: (s["endpointPickerRef"].pop("port"), s["endpointPickerRef"].update(kind="Other"))
        ),
        None,
    ),
    (
        "pool-epp-no-name",
        _with(POOL, lambda s: s["endpointPickerRef"].pop("name")),
        (422, "spec.endpointPickerRef.name: Required value"),
    ),
    (
        "pool-epp-bad-failuremode",
        _with(POOL, _epp(failureMode="Sometimes")),
        (422, 'spec.endpointPickerRef.failureMode: Unsupported value: "Sometimes"'),
    ),
    (
        "pool-epp-port-0",
        _with(POOL, _epp(port={"number": 0})),
        (422, "spec.endpointPickerRef.port.number: Invalid value: 0"),
    ),
    (
        "pool-epp-bad-kind",
        _with(POOL, _epp(kind="bad kind")),
        (422, 'spec.endpointPickerRef.kind: Invalid value: "bad kind"'),
    ),
    # endpointPickerRef is optional in the v1.6.0 CRD.
    ("pool-no-epp", _with(POOL, lambda s: s.pop("endpointPickerRef")), None),
    ("pool-unknown-field", _with(POOL, _set("foo", 1)), (500, ".spec.foo: field not declared in schema")),
    (
        "pool-epp-unknown-field",
        _with(POOL, _epp(foo=1)),
        (500, ".spec.endpointPickerRef.foo: field not declared in schema"),
    ),
    (
        "pool-matchexpressions",
        _with(POOL, lambda s: s["selector"].update(matchExpressions=[{"key": "a", "operator": "Exists"}])),
        (500, ".spec.selector.matchExpressions: field not declared in schema"),
    ),
    ("route-ok", ROUTE, None),
    (
        "route-33-parents",
        _with(ROUTE, _set("parentRefs", [{"name": f"gw{i}"} for i in range(33)])),
        (422, "spec.parentRefs: Too many: 33: must have at most 32 items"),
    ),
    (
        "route-parent-no-name",
        _with(ROUTE, _set("parentRefs", [{"kind": "Gateway"}])),
        (422, "spec.parentRefs[0].name: Required value"),
    ),
    (
        "route-bad-parent-kind",
        _with(ROUTE, lambda s: s["parentRefs"][0].update(kind="bad kind")),
        (422, 'spec.parentRefs[0].kind: Invalid value: "bad kind"'),
    ),
    (
        "route-parent-ns-bad",
        _with(ROUTE, lambda s: s["parentRefs"][0].update(namespace="a.b")),
        (422, 'spec.parentRefs[0].namespace: Invalid value: "a.b"'),
    ),
    (
        "route-dup-parent",
        _with(ROUTE, _set("parentRefs", [{"name": "gw"}, {"name": "gw"}])),
        (422, "spec.parentRefs: Invalid value: sectionName must be unique"),
    ),
    (
        "route-dup-parent-sections",
        _with(
            ROUTE,
            _set("parentRefs", [{"name": "gw", "sectionName": "a"}, {"name": "gw", "sectionName": "b"}]),
        ),
        None,
    ),
    (
        "route-17-rules",
        _with(ROUTE, lambda s: s.update(rules=s["rules"] * 17)),
        (422, "spec.rules: Too many: 17: must have at most 16 items"),
    ),
    ("route-no-rules", _with(ROUTE, _set("rules", [])), (422, "spec.rules: Invalid value: 0")),
    (
        "route-backend-no-name",
        _with(ROUTE, lambda s: s["rules"][0]["backendRefs"][0].pop("name")),
        (422, "spec.rules[0].backendRefs[0].name: Required value"),
    ),
    # canary weights (issue 48 item 4): 0 to 1,000,000
    (
        "route-weight-neg",
        _with(ROUTE, _backend(weight=-1)),
        (422, "spec.rules[0].backendRefs[0].weight: Invalid value: -1"),
    ),
    (
        "route-weight-big",
        _with(ROUTE, _backend(weight=1000001)),
        (422, "spec.rules[0].backendRefs[0].weight: Invalid value: 1000001"),
    ),
    ("route-weight-max", _with(ROUTE, _backend(weight=1000000)), None),
    ("route-weight-0", _with(ROUTE, _backend(weight=0)), None),
    (
        "route-canary-90-10",
        _with(
            ROUTE,
            _rule(
                "backendRefs",
                [{**POOL_REF, "name": "a", "weight": 90}, {**POOL_REF, "name": "b", "weight": 10}],
            ),
        ),
        None,
    ),
    (
        "route-17-backends",
        _with(ROUTE, _rule("backendRefs", [{**POOL_REF, "name": f"p{i}"} for i in range(17)])),
        (422, "spec.rules[0].backendRefs: Too many: 17: must have at most 16 items"),
    ),
    (
        "route-service-no-port",
        _with(ROUTE, _rule("backendRefs", [{"name": "svc"}])),
        (422, "spec.rules[0].backendRefs[0]: Invalid value: Must have port for Service reference"),
    ),
    ("route-service-port", _with(ROUTE, _rule("backendRefs", [{"name": "svc", "port": 80}])), None),
    ("route-pool-with-port", _with(ROUTE, _backend(port=8080)), None),
    (
        "route-path-no-slash",
        _with(ROUTE, _rule("matches", [{"path": {"type": "PathPrefix", "value": "v1"}}])),
        (422, "spec.rules[0].matches[0].path: Invalid value: value must be an absolute path"),
    ),
    (
        "route-path-double-slash",
        _with(ROUTE, _rule("matches", [{"path": {"type": "PathPrefix", "value": "/a//b"}}])),
        (422, "spec.rules[0].matches[0].path: Invalid value: must not contain '//'"),
    ),
    (
        "route-regex-path",
        _with(ROUTE, _rule("matches", [{"path": {"type": "RegularExpression", "value": "v1.*"}}])),
        None,
    ),
    (
        "route-bad-path-type",
        _with(ROUTE, _rule("matches", [{"path": {"type": "Prefix", "value": "/"}}])),
        (422, 'spec.rules[0].matches[0].path.type: Unsupported value: "Prefix"'),
    ),
    (
        "route-bad-hostname",
        _with(ROUTE, _set("hostnames", ["Bad_Host"])),
        (422, 'spec.hostnames[0]: Invalid value: "Bad_Host"'),
    ),
    ("route-unknown-field", _with(ROUTE, _set("foo", 1)), (500, ".spec.foo: field not declared in schema")),
    (
        "route-backend-unknown-field",
        _with(ROUTE, _backend(foo=1)),
        (500, ".spec.rules[0].backendRefs[0].foo: field not declared in schema"),
    ),
]
OBJECTIVE: dict[str, Any] = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
    "kind": "InferenceObjective",
    "metadata": {"name": "o", "namespace": NS},
    "spec": {"priority": 10, "poolRef": {"name": "p"}},
}
CASES += [
    ("objective-ok", OBJECTIVE, None),
    ("objective-negative-priority", _with(OBJECTIVE, _set("priority", -5)), None),
    (
        "objective-pool-v1",
        _with(
            OBJECTIVE,
            _set("poolRef", {"name": "p", "group": "inference.networking.k8s.io", "kind": "InferencePool"}),
        ),
        None,
    ),
    (
        "objective-no-poolref",
        _with(OBJECTIVE, lambda s: s.pop("poolRef")),
        (422, "spec.poolRef: Required value"),
    ),
    (
        "objective-poolref-no-name",
        _with(OBJECTIVE, _set("poolRef", {"kind": "InferencePool"})),
        (422, "spec.poolRef.name: Required value"),
    ),
    (
        "objective-poolref-bad-kind",
        _with(OBJECTIVE, _set("poolRef", {"name": "p", "kind": "bad kind"})),
        (422, 'spec.poolRef.kind: Invalid value: "bad kind"'),
    ),
    (
        "objective-poolref-bad-group",
        _with(OBJECTIVE, _set("poolRef", {"name": "p", "group": "Bad_Group"})),
        (422, 'spec.poolRef.group: Invalid value: "Bad_Group"'),
    ),
    (
        "objective-poolref-name-254",
        _with(OBJECTIVE, _set("poolRef", {"name": "a" * 254})),
        (422, "spec.poolRef.name: Too long: may not be more than 253 bytes"),
    ),
    (
        "objective-priority-float",
        _with(OBJECTIVE, _set("priority", 1.5)),
        (422, 'spec.priority: Invalid value: "number"'),
    ),
    (
        "objective-priority-string",
        _with(OBJECTIVE, _set("priority", "high")),
        (500, ".spec.priority: expected numeric (int or float), got string"),
    ),
    (
        "objective-unknown-field",
        _with(OBJECTIVE, _set("foo", 1)),
        (500, ".spec.foo: field not declared in schema"),
    ),
    (
        "objective-poolref-unknown-field",
        _with(OBJECTIVE, _set("poolRef", {"name": "p", "port": 1})),
        (500, ".spec.poolRef.port: field not declared in schema"),
    ),
]
IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("case", "obj", "real"), CASES, ids=IDS)
def test_the_checker_refuses_what_the_api_server_refused(
    case: str, obj: dict[str, Any], real: tuple[int, str] | None
) -> None:
    errors = gateway_api_errors(copy.deepcopy(obj))
    if real is None:
        assert errors == [], case
    else:
        assert any(real[1] in e for e in errors), (case, errors)


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster(resources={**BASE_RESOURCES, **INFERENCE_EXTENSION}).start()
    yield mock
    mock.stop()


def _apply(cluster: MockCluster, obj: dict[str, Any]) -> tuple[int, str]:
    path = f"{PATHS[obj['kind']].format(ns=NS)}/{obj['metadata']['name']}?fieldManager=test&force=true"
    req = urllib.request.Request(cluster.url + path, data=json.dumps(obj).encode(), method="PATCH")
    req.add_header("Content-Type", "application/apply-patch+yaml")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, str(json.loads(exc.read()).get("message"))


@pytest.mark.parametrize(("case", "obj", "real"), CASES, ids=IDS)
def test_kmock_answers_a_server_side_apply_as_the_api_server_did(
    cluster: MockCluster, case: str, obj: dict[str, Any], real: tuple[int, str] | None
) -> None:
    status, body = _apply(cluster, copy.deepcopy(obj))
    if real is None:
        assert status in (200, 201), (case, status, body)
    else:
        assert status == real[0] and real[1] in body, (case, status, body)
