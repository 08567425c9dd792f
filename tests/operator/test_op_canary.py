"""spec.canary (issue 48 item 4): a second version beside the stable one, its own workload and pool, the
HTTPRoute's weighted split, promotion by an edit, and status.canary; the reconcile under kopf against the
mock API server."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from kubeinfer_operator.common import SERVER_PORT, VARIANT_LABEL, selector_labels
from kubeinfer_operator.gateway import epp_selector_labels
from kubeinfer_operator.render import Capabilities, ChildRef, render_all
from kubeinfer_operator.spec import InferenceModel
from kubeinfer_operator.status import ReconcileOutcome, compute_status
from netpol_eval import Pod, admits
from op_apichecks import api_errors, gateway_api_errors
from op_testlib import inference_model

UID = "0d7e0f5e-3f1b-4a3c-9a0e-5c1d8e2b7a44"
GATEWAY = {"enabled": True, "gatewayRef": {"name": "inference-gw", "namespace": "gw"}}
STABLE = {"uri": "hf://org/model-v1", "servedName": "chat"}
CANARY = {"uri": "hf://org/model-v2"}


def spec(weight: int | None = 10, replicas: int | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": STABLE, "routing": {"gateway": GATEWAY}, **extra}
    if weight is not None:
        body["canary"] = {"model": CANARY, "weight": weight}
        if replicas is not None:
            body["canary"]["replicas"] = replicas
    return body


def make(body: dict[str, Any], name: str = "llm") -> InferenceModel:
    doc = inference_model(body, name=name, namespace="ml")
    doc["metadata"]["uid"] = UID
    return InferenceModel.from_manifest(doc)


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def args_of(deployment: dict[str, Any]) -> list[str]:
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


CANARY_CHILDREN = {
    ChildRef("Deployment", "llm-canary"),
    ChildRef("Service", "llm-canary"),
    ChildRef("NetworkPolicy", "llm-canary"),
    ChildRef("InferencePool", "llm-canary"),
    ChildRef("Deployment", "llm-canary-epp"),
    ChildRef("Service", "llm-canary-epp"),
    ChildRef("ServiceAccount", "llm-canary-epp"),
    ChildRef("Role", "llm-canary-epp"),
    ChildRef("RoleBinding", "llm-canary-epp"),
    ChildRef("NetworkPolicy", "llm-canary-epp"),
}


def refs(objects: list[dict[str, Any]]) -> set[ChildRef]:
    return {ChildRef(o["kind"], o["metadata"]["name"]) for o in objects}


def test_the_canary_is_a_second_workload_and_pool_with_the_route_weighted() -> None:
    plan = render_all(make(spec(10)))
    assert refs(plan.objects) >= CANARY_CHILDREN
    assert not CANARY_CHILDREN & set(plan.absent)
    canary = named(plan.objects, "Deployment", "llm-canary")
    args = args_of(canary)
    # the canary's source, under the stable's served name: clients call both versions alike
    assert flag(args, "--model") == "org/model-v2" and flag(args, "--served-model-name") == "chat"
    assert canary["spec"]["replicas"] == 1
    pod_labels = canary["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[VARIANT_LABEL] == "canary" and pod_labels["app.kubernetes.io/instance"] == "llm-canary"
    # selectors never overlap: the stable Service and pool do not reach the canary's pods, nor back
    stable_sel = named(plan.objects, "Service", "llm")["spec"]["selector"]
    canary_sel = named(plan.objects, "Service", "llm-canary")["spec"]["selector"]
    assert stable_sel != canary_sel
    assert named(plan.objects, "InferencePool", "llm-canary")["spec"]["selector"]["matchLabels"] == canary_sel
    assert named(plan.objects, "InferencePool", "llm-canary")["spec"]["endpointPickerRef"]["name"] == (
        "llm-canary-epp"
    )
    (route,) = [o for o in plan.objects if o["kind"] == "HTTPRoute"]
    backends = [(b["name"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]]
    assert backends == [("llm", 90), ("llm-canary", 10)]
    # the pools exist before the route that sends them traffic
    names = [(o["kind"], o["metadata"]["name"]) for o in plan.objects]
    assert names.index(("InferencePool", "llm-canary")) < names.index(("HTTPRoute", "llm"))
    # the pods share the stable's ServiceAccount (no second one)
    assert canary["spec"]["template"]["spec"]["serviceAccountName"] == "llm"
    assert ChildRef("ServiceAccount", "llm-canary") not in refs(plan.objects)
    for obj in plan.objects:
        assert api_errors(obj) == [] and gateway_api_errors(obj) == [], obj["kind"]


def test_adding_a_canary_rolls_nothing_of_the_stable_version() -> None:
    before = render_all(make(spec(None)))
    after = render_all(make(spec(30)))
    for ref in refs(before.objects) - {ChildRef("HTTPRoute", "llm")}:
        assert named(after.objects, ref.kind, ref.name) == named(before.objects, ref.kind, ref.name), ref


@pytest.mark.parametrize(
    ("weight", "expected"), [(0, [("llm", 100), ("llm-canary", 0)]), (100, [("llm", 0), ("llm-canary", 100)])]
)
def test_weights_0_and_100(weight: int, expected: list[tuple[str, int]]) -> None:
    """0: the canary runs (its own Service answers) and the Gateway sends it nothing; 100: everything."""
    plan = render_all(make(spec(weight)))
    (route,) = [o for o in plan.objects if o["kind"] == "HTTPRoute"]
    assert [(b["name"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]] == expected
    assert refs(plan.objects) >= CANARY_CHILDREN


def test_promotion_is_an_edit_and_deletes_the_canarys_children() -> None:
    promoted = make({"model": {**CANARY, "servedName": "chat"}, "routing": {"gateway": GATEWAY}})
    plan = render_all(promoted)
    assert flag(args_of(named(plan.objects, "Deployment", "llm")), "--model") == "org/model-v2"
    assert set(plan.absent) >= CANARY_CHILDREN
    assert not CANARY_CHILDREN & refs(plan.objects)
    (route,) = [o for o in plan.objects if o["kind"] == "HTTPRoute"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm"}
    ]


def test_the_canarys_pods_are_fenced_like_the_stables() -> None:
    im = make(spec(10))
    policies = [o for o in render_all(im).objects if o["kind"] == "NetworkPolicy"]
    canary_pod = Pod("ml", {**selector_labels(im), "app.kubernetes.io/instance": "llm-canary"})
    canary_epp = Pod("ml", {**epp_selector_labels(im), "app.kubernetes.io/instance": "llm-canary"})
    proxy = Pod("gw", {"app": "envoy"}, namespace_labels={"kubernetes.io/metadata.name": "gw"})
    stranger = Pod("elsewhere", {"app": "x"}, namespace_labels={"kubernetes.io/metadata.name": "elsewhere"})
    assert admits(policies, proxy, canary_pod, SERVER_PORT)
    assert admits(policies, canary_epp, canary_pod, SERVER_PORT)
    assert not admits(policies, stranger, canary_pod, SERVER_PORT)
    assert not admits(policies, stranger, canary_epp, 9002)


def test_without_the_pool_crd_the_canary_runs_and_status_says_nothing_is_split() -> None:
    im = make(spec(25, replicas=2))
    plan = render_all(im, Capabilities(inference_pool=False))
    assert {ChildRef("Deployment", "llm-canary"), ChildRef("Service", "llm-canary")} <= refs(plan.objects)
    assert not [o for o in plan.objects if o["kind"] in ("InferencePool", "HTTPRoute")]
    outcome = ReconcileOutcome(gateway_skipped=plan.gateway_skipped)
    live = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 1},
    }
    status = compute_status(im, None, outcome, None, "2026-01-01T00:00:00Z", canary_deployment=live).to_dict()
    assert status["canary"] == {
        "model": "hf://org/model-v2",
        "weight": 25,
        "replicas": 2,
        "readyReplicas": 1,
        "desiredReplicas": 2,
    }
    (cond,) = [c for c in status["conditions"] if c["type"] == "CanaryReady"]
    assert (cond["status"], cond["reason"]) == ("False", "ReplicasNotReady")
    assert "no traffic split (CRDNotInstalled)" in cond["message"]


def test_status_canary_ready_and_paused() -> None:
    outcome = ReconcileOutcome()
    ready = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1},
    }
    status = compute_status(make(spec(10)), None, outcome, None, "t", canary_deployment=ready).to_dict()
    (cond,) = [c for c in status["conditions"] if c["type"] == "CanaryReady"]
    assert (cond["status"], cond["reason"]) == ("True", "ReplicasReady") and "10% of the gateway's" in cond[
        "message"
    ]
    paused = compute_status(make(spec(10, replicas=0)), None, outcome, None, "t").to_dict()
    (cond,) = [c for c in paused["conditions"] if c["type"] == "CanaryReady"]
    assert (cond["status"], cond["reason"]) == ("False", "Paused")
    none = compute_status(make(spec(None)), None, outcome, None, "t").to_dict()
    assert "canary" not in none and not [c for c in none["conditions"] if c["type"] == "CanaryReady"]


def test_reconcile_renders_both_versions_and_promotion_removes_the_canary(
    cluster_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under kopf against the mock API server with the extension's CRDs: both workloads, both pools and
    the weighted route; the canary's readiness reaches status.canary; promotion (canary.model into
    model, canary dropped) rolls the stable Deployment and deletes every child of the canary."""
    from kubeinfer_operator import handlers
    from kubeinfer_operator.defaults import ClusterDefaults
    from op_cluster import INFERENCE_EXTENSION, condition, run_operator, wait_for

    monkeypatch.setattr(handlers, "DEFAULTS", ClusterDefaults(inference_extension=True))
    cluster = cluster_factory()
    cluster.add_resources(INFERENCE_EXTENSION)
    with run_operator():
        cluster.create("InferenceModel", inference_model(spec(20), name="llm"))
        for kind, name in [
            *((r.kind, r.name) for r in CANARY_CHILDREN),
            ("HTTPRoute", "llm"),
            ("Deployment", "llm"),
        ]:
            wait_for(functools.partial(cluster.get, kind, name), what=f"{kind} {name}")
        route = cluster.get("HTTPRoute", "llm")
        assert route is not None
        weights = [(b["name"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]]
        assert weights == [("llm", 80), ("llm-canary", 20)]

        dep = cluster.get("Deployment", "llm-canary")
        assert dep is not None
        cluster.patch(
            "Deployment",
            "llm-canary",
            {
                "status": {
                    "observedGeneration": dep["metadata"]["generation"],
                    "replicas": 1,
                    "readyReplicas": 1,
                    "updatedReplicas": 1,
                }
            },
            subresource="status",
        )
        cond = wait_for(
            lambda: (
                (c := condition(cluster.get("InferenceModel", "llm"), "CanaryReady")) is not None
                and c["status"] == "True"
                and c
            ),
            what="CanaryReady=True",
        )
        assert "20% of the gateway's traffic" in cond["message"]
        assert (cluster.get("InferenceModel", "llm") or {})["status"]["canary"]["readyReplicas"] == 1

        # promotion: an edit of the spec
        body = cluster.get("InferenceModel", "llm")
        assert body is not None
        body["spec"]["model"] = {**CANARY, "servedName": "chat"}
        del body["spec"]["canary"]
        cluster.replace("InferenceModel", body)
        wait_for(
            lambda: all(cluster.get(ref.kind, ref.name) is None for ref in CANARY_CHILDREN),
            what="every child of the canary deleted",
        )
        stable = cluster.get("Deployment", "llm")
        assert stable is not None and flag(args_of(stable), "--model") == "org/model-v2"
        route = cluster.get("HTTPRoute", "llm")
        assert route is not None and [b["name"] for b in route["spec"]["rules"][0]["backendRefs"]] == ["llm"]
        final = wait_for(
            lambda: (
                (s := (cluster.get("InferenceModel", "llm") or {}).get("status")) and "canary" not in s and s
            ),
            what="status without canary",
        )
        assert not [c for c in final["conditions"] if c["type"] == "CanaryReady"]
