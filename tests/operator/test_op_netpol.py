"""The NetworkPolicies rendered for a model (netpol.py), evaluated against the labels of the pods the
operator renders: each pod admits exactly what it needs (clients, router, operator and Prometheus on
the API port; KV events from the router only; a multi-node model's ranks from each other only)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator.defaults import ClusterDefaults
from kubeinfer_operator.lws import WORKER_INDEX_LABEL
from kubeinfer_operator.netpol import operator_namespace
from kubeinfer_operator.render import Capabilities, ChildRef, render_all
from kubeinfer_operator.spec import InferenceModel
from netpol_eval import Pod, admits
from op_testlib import K8S_VERSIONS, inference_model

NS = "ml"
UID = "0c7d5e4a-1111-4222-8333-944445555666"
HF = {"uri": "hf://org/model"}
DEFAULTS = ClusterDefaults(
    operator_namespace="kubeinfer-system",
    operator_pod_labels=(("app.kubernetes.io/name", "kubeinfer"), ("app.kubernetes.io/instance", "ki")),
    monitoring_namespace="monitoring",
)
CAPS = Capabilities(defaults=DEFAULTS)
MULTI_NODE: dict[str, Any] = {
    "parallelism": {"nodes": 2},
    "engine": {"tensorParallelSize": 2},
    "resources": {"gpu": {"count": 1}},
}

CLIENT = Pod(NS, {"app": "chat-frontend"})
STRANGER = Pod("other", {"app": "chat-frontend"})
OPERATOR = Pod(
    "kubeinfer-system", {"app.kubernetes.io/name": "kubeinfer", "app.kubernetes.io/instance": "ki"}
)
FAKE_OPERATOR = Pod("other", {"app.kubernetes.io/name": "kubeinfer", "app.kubernetes.io/instance": "ki"})
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
GRAFANA = Pod("monitoring", {"app.kubernetes.io/name": "grafana"})
API, KV_EVENTS, KV_REPLAY, ROUTER_API, ROUTER_METRICS, DIST, EPHEMERAL = (
    8080,
    5557,
    5558,
    8000,
    29000,
    29500,
    41234,
)


def plan(**spec: Any) -> tuple[list[dict[str, Any]], dict[str, Pod]]:
    """The model's policies and its pods, as the controllers would label them."""
    doc = inference_model({"model": HF, **spec}, name="llm", namespace=NS)
    doc["metadata"]["uid"] = UID
    objects = render_all(InferenceModel.from_manifest(doc), CAPS).objects
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods: dict[str, Pod] = {}
    for o in objects:
        if o["kind"] == "Deployment":
            name = o["metadata"]["name"].rsplit("-", 1)[-1]
            name = name if name in ("router", "activator") else "model"
            pods[name] = Pod(NS, dict(o["spec"]["template"]["metadata"]["labels"]))
        elif o["kind"] == "LeaderWorkerSet":
            tmpl = o["spec"]["leaderWorkerTemplate"]
            pods["model"] = Pod(NS, {**tmpl["leaderTemplate"]["metadata"]["labels"], WORKER_INDEX_LABEL: "0"})
            pods["worker"] = Pod(
                NS, {**tmpl["workerTemplate"]["metadata"]["labels"], WORKER_INDEX_LABEL: "1"}
            )
    return policies, pods


def test_policies_are_valid_objects() -> None:
    for spec in ({}, {"routing": {"enabled": True}}, MULTI_NODE):
        policies, _ = plan(**spec)
        assert policies
        for p in policies:
            kubernetes_validate.validate(p, K8S_VERSIONS[-1], strict=True)
            assert p["metadata"]["ownerReferences"][0]["uid"] == UID


def test_model_api_admits_its_namespace_the_operator_and_prometheus_only() -> None:
    policies, pods = plan()
    model = pods["model"]
    for src in (CLIENT, OPERATOR, PROMETHEUS):
        assert admits(policies, src, model, API), src
    for src in (STRANGER, FAKE_OPERATOR, GRAFANA):
        assert not admits(policies, src, model, API), src
    # nothing else is open: no KV events without a router, no other port
    assert not admits(policies, CLIENT, model, KV_EVENTS)
    assert not admits(policies, CLIENT, model, EPHEMERAL)


def test_router_reaches_the_kv_events_and_clients_reach_the_router() -> None:
    policies, pods = plan(routing={"enabled": True, "policy": "kv_aware"})
    model, router = pods["model"], pods["router"]
    for port in (API, KV_EVENTS, KV_REPLAY):
        assert admits(policies, router, model, port), port
    assert not admits(policies, CLIENT, model, KV_EVENTS) and not admits(policies, CLIENT, model, KV_REPLAY)
    assert admits(policies, CLIENT, router, ROUTER_API)
    assert not admits(policies, STRANGER, router, ROUTER_API)
    assert not admits(policies, CLIENT, router, ROUTER_METRICS)
    assert admits(policies, PROMETHEUS, router, ROUTER_METRICS)


def test_allowed_clients_replace_the_namespace() -> None:
    peers = [
        {
            "namespaceSelector": {"matchLabels": {"team": "search"}},
            "podSelector": {"matchLabels": {"app": "ui"}},
        }
    ]
    policies, pods = plan(network={"allowedClients": peers}, routing={"enabled": True})
    search_ui = Pod("search", {"app": "ui"}, {"team": "search"})
    search_batch = Pod("search", {"app": "batch"}, {"team": "search"})
    assert admits(policies, search_ui, pods["model"], API)
    assert admits(policies, search_ui, pods["router"], ROUTER_API)
    assert not admits(policies, search_batch, pods["model"], API)
    assert not admits(policies, CLIENT, pods["model"], API)  # the namespace is no longer the default
    assert admits(policies, pods["router"], pods["model"], API)  # the router, operator stay
    assert admits(policies, OPERATOR, pods["model"], API)


@pytest.mark.parametrize("routing", [False, True])
def test_the_activator_reaches_its_upstream_and_clients_reach_the_activator(routing: bool) -> None:
    # scale to zero: clients call the activator, which sends on to the router (routing) or the model
    peers = [{"podSelector": {"matchLabels": {"app": "chat-frontend"}}}]
    policies, pods = plan(
        scaling={"minReplicas": 0, "replicas": 1},
        network={"allowedClients": peers},
        routing={"enabled": routing},
    )
    activator, model = pods["activator"], pods["model"]
    assert admits(policies, CLIENT, activator, ROUTER_API)  # the activator's port is 8000 too
    assert admits(policies, PROMETHEUS, activator, ROUTER_API)
    assert not admits(policies, STRANGER, activator, ROUTER_API)
    assert not admits(policies, CLIENT, activator, API)
    if routing:
        assert admits(policies, activator, pods["router"], ROUTER_API)
        assert not admits(policies, activator, model, API)  # it goes through the router
    else:
        assert admits(policies, activator, model, API)
    # without scale to zero no activator is admitted anywhere
    policies, pods = plan(network={"allowedClients": peers}, routing={"enabled": routing})
    assert "activator" not in pods
    assert not admits(policies, activator, pods["model"], API)


def test_ranks_reach_each_other_and_nobody_else_does() -> None:
    policies, pods = plan(**MULTI_NODE)
    leader, worker = pods["model"], pods["worker"]
    for port in (DIST, EPHEMERAL):
        assert admits(policies, worker, leader, port) and admits(policies, leader, worker, port), port
        assert not admits(policies, CLIENT, worker, port) and not admits(policies, CLIENT, leader, port)
    assert admits(policies, CLIENT, leader, API)
    # another model's ranks in the same namespace are no peers
    other = Pod(NS, {**worker.labels, "app.kubernetes.io/instance": "other-model"})
    assert not admits(policies, other, worker, DIST)


def test_opting_out_renders_none_and_deletes_what_was_rendered() -> None:
    doc = inference_model({"model": HF, "network": {"networkPolicy": False}}, name="llm", namespace=NS)
    doc["metadata"]["uid"] = UID
    p = render_all(InferenceModel.from_manifest(doc), CAPS)
    assert not [o for o in p.objects if o["kind"] == "NetworkPolicy"]
    assert {ChildRef("NetworkPolicy", "llm"), ChildRef("NetworkPolicy", "llm-router")} <= set(p.absent)
    policies, pods = plan(network={"networkPolicy": False})
    assert policies == [] and admits(policies, STRANGER, pods["model"], EPHEMERAL)


def test_without_the_charts_environment_the_operator_is_matched_in_its_own_namespace(tmp_path: Any) -> None:
    """Issue 45 item 4: without POD_NAMESPACE the operator peer was `app.kubernetes.io/name: kubeinfer`
    in every namespace, a label anyone creating a pod can set."""
    doc = inference_model({"model": HF}, name="llm", namespace=NS)
    objects = render_all(InferenceModel.from_manifest(doc), Capabilities(defaults=ClusterDefaults())).objects
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert not admits([policy], FAKE_OPERATOR, Pod(NS, policy["spec"]["podSelector"]["matchLabels"]), API)
    assert all(p.get("namespaceSelector") != {} for p in policy["spec"]["ingress"][0]["from"])
    sa_file = tmp_path / "namespace"
    sa_file.write_text("kubeinfer-system\n")
    assert operator_namespace(ClusterDefaults(), str(sa_file)) == "kubeinfer-system"
    assert operator_namespace(ClusterDefaults(operator_namespace="ops"), str(sa_file)) == "ops"
    assert operator_namespace(ClusterDefaults(), str(tmp_path / "absent")) is None


DNS = Pod("kube-system", {"k8s-app": "kube-dns"})
FAKE_DNS = Pod(NS, {"k8s-app": "kube-dns"})


def _egress_to_internet(policies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (model,) = [p for p in policies if p["metadata"]["name"] == "llm"]
    return [r for r in model["spec"]["egress"] if any("ipBlock" in peer for peer in r.get("to") or [])]


def test_model_pods_reach_dns_and_the_hub_only() -> None:
    """Issue 45 item 1: the model's pods had the namespace's egress (any host, the API server, the
    cloud metadata service), so a leaked credential could go anywhere."""
    policies, pods = plan()
    model = pods["model"]
    assert admits(policies, model, DNS, 53, "UDP") and admits(policies, model, DNS, 53)
    for dst, port in ((FAKE_DNS, 53), (CLIENT, API), (OPERATOR, 443), (STRANGER, 443), (PROMETHEUS, 9090)):
        assert not admits(policies, model, dst, port), (dst, port)
    (hub,) = _egress_to_internet(policies)
    assert hub["ports"] == [{"protocol": "TCP", "port": 443}]
    v4 = [p["ipBlock"] for p in hub["to"] if p["ipBlock"]["cidr"] == "0.0.0.0/0"]
    assert v4 == [{"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}]


@pytest.mark.parametrize("uri", ["pvc://models/llama", "/models/llama"])
def test_models_without_a_hub_download_get_no_internet(uri: str) -> None:
    doc = inference_model({"model": {"uri": uri}}, name="llm", namespace=NS)
    objects = render_all(InferenceModel.from_manifest(doc), CAPS).objects
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert _egress_to_internet(policies) == []
    # an hf:// adapter brings the hub back
    doc = inference_model(
        {"model": {"uri": uri}, "adapters": [{"name": "a", "uri": "hf://org/lora"}]}, name="llm", namespace=NS
    )
    objects = render_all(InferenceModel.from_manifest(doc), CAPS).objects
    assert _egress_to_internet([o for o in objects if o["kind"] == "NetworkPolicy"]) != []


def test_ranks_reach_each_other_on_egress_too() -> None:
    policies, pods = plan(**MULTI_NODE)
    assert admits(policies, pods["worker"], pods["model"], DIST)
    assert admits(policies, pods["model"], pods["worker"], EPHEMERAL)
    assert not admits(policies, pods["model"], CLIENT, EPHEMERAL)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ClusterDefaults()),
        (
            {
                "POD_NAMESPACE": "ops",
                "KUBEINFER_OPERATOR_POD_LABELS": "app.kubernetes.io/name=kubeinfer,app.kubernetes.io/instance=r",
                "KUBEINFER_MONITORING_NAMESPACE": "prom",
                "KUBEINFER_PROMETHEUS_POD_LABELS": "",
            },
            ClusterDefaults(
                operator_namespace="ops",
                operator_pod_labels=(
                    ("app.kubernetes.io/name", "kubeinfer"),
                    ("app.kubernetes.io/instance", "r"),
                ),
                monitoring_namespace="prom",
                prometheus_pod_labels=(),
            ),
        ),
    ],
)
def test_network_defaults_from_the_environment(env: dict[str, str], expected: ClusterDefaults) -> None:
    assert ClusterDefaults.from_environment(env) == expected
