"""spec.routing.gateway: the Gateway API Inference Extension's InferencePool, its endpoint picker and an
HTTPRoute, rendered from the spec; a cluster without the extension keeps a serving model."""

from __future__ import annotations

from typing import Any

import pytest
from kubeinfer_operator.common import SERVER_PORT, selector_labels
from kubeinfer_operator.gateway import EPP_GRPC_PORT, epp_name, epp_selector_labels
from kubeinfer_operator.render import Capabilities, ChildRef, render_all
from kubeinfer_operator.spec import InferenceModel, InvalidSpecError
from kubeinfer_operator.status import ReconcileOutcome, gateway_condition
from netpol_eval import Pod, admits
from op_apichecks import api_errors, gateway_api_errors
from op_testlib import inference_model

UID = "6f1c8c0e-8a57-4a4c-9d6e-2f7f2b1f0a11"


def make(gateway: dict[str, Any] | None, name: str = "llm", **spec: Any) -> InferenceModel:
    body: dict[str, Any] = {"model": {"uri": "hf://org/model"}, **spec}
    if gateway is not None:
        body["routing"] = {"gateway": gateway}
    doc = inference_model(body, name=name, namespace="ml")
    doc["metadata"]["uid"] = UID
    return InferenceModel.from_manifest(doc)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


GATEWAY = {"enabled": True, "gatewayRef": {"name": "inference-gw", "namespace": "gw"}}


def test_off_renders_nothing_and_removes_what_may_exist() -> None:
    plan = render_all(make(None))
    assert not by_kind(plan.objects, "InferencePool") and not by_kind(plan.objects, "HTTPRoute")
    assert {
        ChildRef("InferencePool", "llm"),
        ChildRef("HTTPRoute", "llm"),
        ChildRef("Deployment", "llm-epp"),
    } <= set(plan.absent)
    assert plan.gateway_skipped is None


def test_pool_selects_the_serving_pods_on_the_api_port() -> None:
    plan = render_all(make(GATEWAY))
    (pool,) = by_kind(plan.objects, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == selector_labels(make(GATEWAY))
    assert spec["targetPorts"] == [{"number": SERVER_PORT}]
    assert spec["endpointPickerRef"] == {
        "kind": "Service",
        "name": "llm-epp",
        "port": {"number": EPP_GRPC_PORT},
        "failureMode": "FailClose",
    }
    assert gateway_api_errors(pool) == []
    # The model's own Deployment's pods carry the pool's selector.
    (dep,) = [o for o in by_kind(plan.objects, "Deployment") if o["metadata"]["name"] == "llm"]
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= template_labels.items()


def test_endpoint_picker_objects() -> None:
    im = make({**GATEWAY, "endpointPicker": {"image": "registry.example.com/epp:v1", "replicas": 2}})
    objects = render_all(im).objects
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment", "NetworkPolicy"):
        assert (kind, epp_name(im)) in names, kind
    (dep,) = [o for o in by_kind(objects, "Deployment") if o["metadata"]["name"] == "llm-epp"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.example.com/epp:v1" and dep["spec"]["replicas"] == 2
    assert c["args"][c["args"].index("--pool-name") + 1] == "llm"
    assert c["args"][c["args"].index("--pool-namespace") + 1] == "ml"
    # its Role grants no tokenreviews/subjectaccessreviews, so the picker must not authenticate scrapes
    # with them (its default): its metrics port is fenced to Prometheus instead
    assert "--metrics-endpoint-auth=false" in c["args"]
    assert c["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    (role,) = [o for o in by_kind(objects, "Role") if o["metadata"]["name"] == "llm-epp"]
    verbs = {v for r in role["rules"] for v in r["verbs"]}
    assert verbs == {"get", "list", "watch"}  # read-only
    for obj in objects:
        assert api_errors(obj) == [], obj["kind"]


def test_http_route_attaches_the_pool_to_the_named_gateway() -> None:
    (route,) = by_kind(render_all(make(GATEWAY)).objects, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gw", "namespace": "gw"}
    ]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm"}
    ]
    assert gateway_api_errors(route) == []
    # No gatewayRef: no route (the platform team writes its own).
    assert not by_kind(render_all(make({"enabled": True})).objects, "HTTPRoute")


def test_missing_crd_keeps_the_model_serving() -> None:
    im = make(GATEWAY)
    plan = render_all(im, Capabilities(inference_pool=False, http_route=False))
    kinds = {o["kind"] for o in plan.objects}
    assert "Deployment" in kinds and "Service" in kinds
    assert not {"InferencePool", "HTTPRoute"} & kinds
    assert not [o for o in plan.objects if o["metadata"]["name"] == epp_name(im)]
    # Kinds the cluster does not serve are never listed for deletion.
    assert not [r for r in plan.absent if r.kind in ("InferencePool", "HTTPRoute")]
    assert plan.gateway_skipped is not None and plan.gateway_skipped.reason == "CRDNotInstalled"
    assert "InferencePool" in plan.gateway_skipped.message

    def cond(ctype: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {"type": ctype, "status": status, "reason": reason, "message": message}

    got = gateway_condition(ReconcileOutcome(gateway_skipped=plan.gateway_skipped), cond)  # type: ignore[arg-type]
    assert (got["type"], got["status"], got["reason"]) == ("GatewayAvailable", "False", "CRDNotInstalled")
    # The pool's CRD without the Gateway API's: the pool and picker, no route, and a reason naming it.
    plan = render_all(im, Capabilities(http_route=False))
    assert by_kind(plan.objects, "InferencePool") and not by_kind(plan.objects, "HTTPRoute")
    assert plan.gateway_skipped is not None and "HTTPRoute" in plan.gateway_skipped.message
    ok = gateway_condition(ReconcileOutcome(), cond)  # type: ignore[arg-type]
    assert (ok["status"], ok["reason"]) == ("True", "InferencePoolApplied")


def test_an_installation_without_the_extension_never_touches_its_kinds() -> None:
    """inferenceExtension.enabled false (the chart grants no RBAC for these kinds): nothing of them is
    rendered, read or deleted, for models with and without spec.routing.gateway, and a model that asks
    is told why."""
    caps = Capabilities(inference_extension=False)
    for im in (make(GATEWAY), make(None)):
        plan = render_all(im, caps)
        assert not [o for o in plan.objects if o["kind"] in ("InferencePool", "HTTPRoute")]
        # Kinds the operator holds no RBAC for are never read or deleted (a stale picker's Deployment or
        # NetworkPolicy, kinds it does hold, may still be cleaned up).
        assert not [r for r in plan.absent if r.kind in ("InferencePool", "HTTPRoute")]
        assert not [o for o in plan.objects if o["metadata"]["name"] == epp_name(im)]
    skip = render_all(make(GATEWAY), caps).gateway_skipped
    assert skip is not None and skip.reason == "NotEnabled" and "inferenceExtension.enabled" in skip.message


def test_the_installation_switch_comes_from_the_environment() -> None:
    from kubeinfer_operator.defaults import ClusterDefaults

    assert ClusterDefaults.from_environment({}).inference_extension is False
    assert (
        ClusterDefaults.from_environment({"KUBEINFER_INFERENCE_EXTENSION": "true"}).inference_extension
        is True
    )


def test_network_policies_admit_the_picker_and_the_gateway_only() -> None:
    im = make(GATEWAY)
    policies = by_kind(render_all(im).objects, "NetworkPolicy")
    model_pod = Pod("ml", {**selector_labels(im), "app.kubernetes.io/component": "inference-server"})
    epp_pod = Pod("ml", epp_selector_labels(im))
    proxy = Pod("gw", {"app": "envoy"}, namespace_labels={"kubernetes.io/metadata.name": "gw"})
    stranger = Pod("elsewhere", {"app": "x"}, namespace_labels={"kubernetes.io/metadata.name": "elsewhere"})
    assert admits(policies, epp_pod, model_pod, SERVER_PORT)  # the picker scrapes /metrics
    assert admits(policies, proxy, model_pod, SERVER_PORT)  # the gateway forwards to the pods
    assert admits(policies, proxy, epp_pod, EPP_GRPC_PORT)  # and asks the picker
    assert not admits(policies, stranger, epp_pod, EPP_GRPC_PORT)
    assert not admits(policies, stranger, model_pod, SERVER_PORT)


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({"enabled": True, "endpointPicker": {"image": "not an image"}}, "image reference"),
        ({"enabled": True, "gatewayRef": {"name": "Bad_Name"}}, "gatewayRef.name"),
        ({"enabled": True, "endpointPicker": {"failureMode": "Maybe"}}, "failureMode"),
    ],
)
def test_bad_gateway_specs_are_refused(gateway: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        make(gateway)
    assert message in str(info.value)


def test_without_the_crd_the_model_serves_and_the_pool_appears_with_it(
    cluster_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under kopf against the mock API server: the extension's CRD missing, the model deploys with
    GatewayAvailable=False and nothing of the extension is written; once the CRD is served, the pool, its
    picker and the route appear and the condition turns True."""
    import functools

    from kubeinfer_operator import handlers
    from kubeinfer_operator.defaults import ClusterDefaults
    from op_cluster import INFERENCE_EXTENSION, condition, run_operator, wait_for

    monkeypatch.setattr(handlers, "DEFAULTS", ClusterDefaults(inference_extension=True))
    cluster = cluster_factory()
    spec = {"model": {"uri": "hf://org/model"}, "routing": {"gateway": GATEWAY}}
    with run_operator():
        cluster.create("InferenceModel", inference_model(spec, name="llm"))
        wait_for(functools.partial(cluster.get, "Deployment", "llm"), what="Deployment")
        cond = wait_for(
            lambda: condition(cluster.get("InferenceModel", "llm"), "GatewayAvailable"), what="condition"
        )
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
        assert cluster.get("Deployment", "llm-epp") is None

        cluster.add_resources(INFERENCE_EXTENSION)
        pool = wait_for(
            functools.partial(cluster.get, "InferencePool", "llm"), timeout=90, what="InferencePool"
        )
        assert pool["spec"]["endpointPickerRef"]["name"] == "llm-epp"
        wait_for(functools.partial(cluster.get, "HTTPRoute", "llm"), timeout=90, what="HTTPRoute")
        wait_for(functools.partial(cluster.get, "Deployment", "llm-epp"), timeout=90, what="picker")
        wait_for(
            lambda: (
                (condition(cluster.get("InferenceModel", "llm"), "GatewayAvailable") or {}).get("status")
                == "True"
            ),
            timeout=90,
            what="GatewayAvailable=True",
        )


def test_installing_the_extensions_crds_brings_the_pool_without_waiting_for_the_resync(
    cluster_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on a real kube-apiserver (issue 48): the pool came only with the periodic resync after its CRD
    was installed (the CRD watch ignored the extension's CRDs). Resync, watch re-listing and discovery
    cache all set to 10 minutes here: only the CRD's own watch event can bring the pool in."""
    import functools

    from kubeinfer_operator import handlers
    from kubeinfer_operator.defaults import ClusterDefaults
    from op_cluster import INFERENCE_EXTENSION, condition, run_operator, wait_for

    monkeypatch.setattr(handlers, "DEFAULTS", ClusterDefaults(inference_extension=True))
    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 600.0)
    monkeypatch.setattr(handlers, "DISCOVERY_TTL_SECONDS", 600.0)
    cluster = cluster_factory()
    spec = {"model": {"uri": "hf://org/model"}, "routing": {"gateway": {**GATEWAY, "priority": -1}}}
    with run_operator(server_timeout=600):
        cluster.create("InferenceModel", inference_model(spec, name="llm"))
        cond = wait_for(
            lambda: condition(cluster.get("InferenceModel", "llm"), "GatewayAvailable"), what="condition"
        )
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")

        objectives = {k: v for k, v in INFERENCE_EXTENSION.items() if v.kind == "InferenceObjective"}
        cluster.install_crds({k: v for k, v in INFERENCE_EXTENSION.items() if k not in objectives})
        wait_for(functools.partial(cluster.get, "InferencePool", "llm"), timeout=30, what="InferencePool")
        wait_for(functools.partial(cluster.get, "HTTPRoute", "llm"), timeout=30, what="HTTPRoute")
        # The objective's CRD on its own, later (the extension's v1.6.0 no longer ships it).
        cluster.install_crds(objectives)
        objective = wait_for(
            functools.partial(cluster.get, "InferenceObjective", "llm"), timeout=30, what="InferenceObjective"
        )
        assert objective["spec"]["priority"] == 1


def test_inference_objective_carries_the_models_priority_with_the_extensions_sign() -> None:
    """spec.routing.gateway.priority is a request priority in the server's terms (lower first, vLLM's
    --scheduling-policy priority); the extension's InferenceObjective serves higher values first
    ("Priority 10 will always be served before 0"), so the objective holds the value negated."""
    plan = render_all(make({**GATEWAY, "priority": -5}))
    (objective,) = by_kind(plan.objects, "InferenceObjective")
    assert gateway_api_errors(objective) == [] and api_errors(objective) == []
    assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert (
        objective["metadata"]["name"] == "llm" and objective["metadata"]["ownerReferences"][0]["uid"] == UID
    )
    assert objective["spec"] == {
        "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm"},
        "priority": 5,
    }
    # Two models in one namespace: the more urgent in the server's terms is the higher objective.
    urgent = by_kind(render_all(make({**GATEWAY, "priority": -5}, name="chat")).objects, "InferenceObjective")
    batch = by_kind(render_all(make({**GATEWAY, "priority": 3}, name="batch")).objects, "InferenceObjective")
    assert urgent[0]["spec"]["priority"] > batch[0]["spec"]["priority"]
    # Without a priority, or without the objective's CRD: none, and a removed one is deleted.
    plain = render_all(make(GATEWAY))
    assert not by_kind(plain.objects, "InferenceObjective")
    assert ChildRef("InferenceObjective", "llm") in plain.absent and plain.gateway_skipped is None
    missing = render_all(make({**GATEWAY, "priority": 1}), Capabilities(inference_objective=False))
    assert not by_kind(missing.objects, "InferenceObjective") and by_kind(missing.objects, "InferencePool")
    assert ChildRef("InferenceObjective", "llm") not in missing.absent
    skip = missing.gateway_skipped
    assert skip is not None and skip.reason == "CRDNotInstalled" and "InferenceObjective" in skip.message
    off = render_all(make({**GATEWAY, "priority": 1}), Capabilities(inference_extension=False))
    assert not [r for r in off.absent if r.kind == "InferenceObjective"]


def test_a_resync_rewrites_a_gateway_condition_that_no_longer_holds() -> None:
    """Seen on a real kube-apiserver (issue 48): the InferenceObjective's CRD deleted, GatewayAvailable
    stayed True, since no child changed and a resync writes status only with an apply. The resync now
    counts a condition that disagrees with the plan as drift."""
    from kubeinfer_operator.reconciler import _gateway_condition_stale

    im = make({**GATEWAY, "priority": -1})
    served, unserved = render_all(im), render_all(im, Capabilities(inference_objective=False))

    def body(status: str, message: str = "") -> dict[str, Any]:
        return {
            "status": {"conditions": [{"type": "GatewayAvailable", "status": status, "message": message}]}
        }

    skip = unserved.gateway_skipped
    assert skip is not None
    true, false = body("True"), body("False", f"{skip.message}: the model serves through its Service")
    assert _gateway_condition_stale(true, im, unserved)  # the CRD went away
    assert _gateway_condition_stale(false, im, served)  # and came back
    assert not _gateway_condition_stale(true, im, served)
    assert not _gateway_condition_stale(false, im, unserved)
    assert not _gateway_condition_stale({}, im, unserved)  # never reported: the first reconcile writes it
    assert not _gateway_condition_stale(false, make(None), render_all(make(None)))  # no gateway wanted


def test_the_server_maps_the_objective_header_to_the_models_priority() -> None:
    """With routing.gateway.priority the server schedules by priority and maps the objective the picker
    selects by (x-gateway-inference-objective: <pool>) to the spec's value, so a request without a body
    priority is queued as the gateway ordered it (server/api/objectives.py); a user's fcfs is refused."""

    def server_args(im: InferenceModel) -> list[str]:
        (deployment,) = [
            d for d in by_kind(render_all(im).objects, "Deployment") if d["metadata"]["name"] == "llm"
        ]
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    args = server_args(make({**GATEWAY, "priority": -5}))
    at = args.index("--objective-priority")
    assert args[at + 1] == "llm=-5"
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    assert "--objective-priority" not in server_args(make(GATEWAY))
    assert "--objective-priority" not in server_args(make({"priority": 2}))  # gateway not enabled
    for extra in (["--scheduling-policy", "fcfs"], ["--scheduling-policy=fcfs"]):
        with pytest.raises(InvalidSpecError, match="scheduling-policy"):
            make({**GATEWAY, "priority": 1}, engine={"extraArgs": extra})
    assert "--objective-priority" in server_args(
        make({**GATEWAY, "priority": 1}, engine={"extraArgs": ["--scheduling-policy", "priority"]})
    )
