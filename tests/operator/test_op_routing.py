"""spec.routing: the router objects (ServiceAccount, Role, RoleBinding, Service, PDB, Deployment,
ServiceMonitor) rendered, valid (kubernetes-validate --strict; the vendored ServiceMonitor schema), least
privilege, discovering exactly the model's pods, and the servers' KV-event flags under kv_aware."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from kubeinfer_operator.render import (
    SERVER_PORT,
    Capabilities,
    ChildRef,
    labels,
    render_all,
    render_deployment,
)
from kubeinfer_operator.routing import (
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    ROUTER_KINDS,
    ROUTER_METRICS_PORT,
    ROUTER_PORT,
    render_router,
    router_selector_labels,
)
from kubeinfer_operator.spec import DEFAULT_ROUTER_IMAGE, InferenceModel
from op_testlib import K8S_VERSIONS, inference_model, load_json_schema
from test_op_render import CRD_KIND_SCHEMAS

UID = "6f1c8c0e-8a57-4a4c-9d6e-2f7f2b1f0a11"


def make(routing: dict[str, Any] | None, **spec: Any) -> InferenceModel:
    body: dict[str, Any] = {"model": {"uri": "hf://org/model"}, **spec}
    if routing is not None:
        body["routing"] = routing
    doc = inference_model(body, name="llm", namespace="ml")
    doc["metadata"]["uid"] = UID
    return InferenceModel.from_manifest(doc)


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {o["kind"]: o for o in objs}
    assert len(out) == len(objs), "one object per kind"
    return out


def flag_values(args: list[str], name: str) -> list[str]:
    i = args.index(name)
    out = []
    for a in args[i + 1 :]:
        if a.startswith("--"):
            break
        out.append(a)
    return out


def test_routing_off_renders_nothing() -> None:
    im = make(None)
    assert render_router(im) == []
    assert all(o["metadata"]["name"] == "llm" for o in render_all(im).objects)
    assert (
        "--kv-events-config" not in render_deployment(im)["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_router_objects() -> None:
    im = make({"enabled": True})
    objs = by_kind(render_router(im))
    assert set(objs) == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "PodDisruptionBudget",
        "Deployment",
        "ServiceMonitor",
    }
    for o in objs.values():
        assert o["metadata"]["name"] == "llm-router" and o["metadata"]["namespace"] == "ml"
        assert o["metadata"]["ownerReferences"][0]["uid"] == UID
    # Least privilege: read pods in this namespace, nothing else.
    assert objs["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert objs["RoleBinding"]["roleRef"]["name"] == "llm-router"
    assert objs["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "llm-router", "namespace": "ml"}
    ]
    dep = objs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llm-router" and dep["spec"]["replicas"] == 2
    (c,) = pod["containers"]
    assert c["image"] == DEFAULT_ROUTER_IMAGE
    args = c["args"]
    assert flag_values(args, "--policy") == ["cache_aware"]
    assert flag_values(args, "--service-discovery-namespace") == ["ml"]
    assert flag_values(args, "--service-discovery-port") == [str(SERVER_PORT)]
    assert flag_values(args, "--health-check-endpoint") == ["/ready"]
    assert int(flag_values(args, "--retry-max-retries")[0]) >= 1
    # Discovery selects exactly the model's server pods (their labels), not the router's own.
    selector = dict(s.split("=", 1) for s in flag_values(args, "--selector"))
    server_pod_labels = render_deployment(im)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= server_pod_labels.items()
    assert not selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()  # not itself
    assert dep["spec"]["selector"]["matchLabels"] == router_selector_labels(im)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    ports = {p["name"]: p["port"] for p in objs["Service"]["spec"]["ports"]}
    assert ports == {"http": ROUTER_PORT, "metrics": ROUTER_METRICS_PORT}
    assert objs["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == router_selector_labels(im)


def test_one_router_replica_has_no_pdb_and_monitoring_follows_the_switch() -> None:
    im = make({"enabled": True, "replicas": 1}, monitoring={"serviceMonitor": {"enabled": False}})
    kinds = {o["kind"] for o in render_router(im, service_monitor=False)}
    assert "PodDisruptionBudget" not in kinds and "ServiceMonitor" not in kinds
    plan = render_all(im, Capabilities(service_monitor=True))
    assert not any(o["kind"] == "ServiceMonitor" for o in plan.objects)


def test_plan_wants_every_router_object_absent_that_it_does_not_render() -> None:
    def router_absent(im: InferenceModel) -> set[str]:
        return {ref.kind for ref in render_all(im).absent if ref.name == "llm-router"}

    # the router's NetworkPolicy (netpol.py) goes with it
    assert router_absent(make(None)) == {*ROUTER_KINDS, "NetworkPolicy"}
    assert router_absent(make({"enabled": False})) == {*ROUTER_KINDS, "NetworkPolicy"}
    assert router_absent(make({"enabled": True, "replicas": 2})) == set()
    assert router_absent(make({"enabled": True, "replicas": 1})) == {"PodDisruptionBudget"}
    off = make({"enabled": False})
    # Deleted workload first, RBAC last (the reverse of apply order); the model's own children keep
    # their names.
    router_refs = [
        ref for ref in render_all(off).absent if ref.name == "llm-router" and ref.kind != "NetworkPolicy"
    ]
    assert [r.kind for r in router_refs] == list(reversed(ROUTER_KINDS))
    assert ChildRef("PodDisruptionBudget", "llm") in render_all(off).absent
    plan = render_all(make({"enabled": True, "replicas": 2}))
    assert not {ChildRef(o["kind"], o["metadata"]["name"]) for o in plan.objects} & set(plan.absent)
    assert {o["kind"] for o in render_router(make({"enabled": True, "replicas": 2}))} == set(ROUTER_KINDS)


def test_kv_aware_turns_on_the_servers_kv_events() -> None:
    im = make({"enabled": True, "policy": "kv_aware"})
    c = render_deployment(im)["spec"]["template"]["spec"]["containers"][0]
    cfg = json.loads(flag_values(c["args"], "--kv-events-config")[0])
    assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
    assert cfg["endpoint"].endswith(f":{KV_EVENTS_PORT}") and cfg["replay_endpoint"].endswith(
        f":{KV_REPLAY_PORT}"
    )
    # The server's own parser accepts what the operator renders.
    from server.config import KVEventsConfig

    assert KVEventsConfig.from_json(json.dumps(cfg)).enabled
    assert {p["containerPort"] for p in c["ports"]} >= {KV_EVENTS_PORT, KV_REPLAY_PORT}


def test_plan_keeps_the_models_objects_last_per_kind() -> None:
    im = make({"enabled": True})
    plan = render_all(im)
    wanted = {o["kind"]: o for o in plan.objects}  # how the handlers index the plan
    assert wanted["Deployment"]["metadata"]["name"] == "llm"
    assert wanted["Service"]["metadata"]["name"] == "llm"
    assert labels(im).items() <= wanted["Deployment"]["metadata"]["labels"].items()


ALL = render_router(make({"enabled": True, "policy": "kv_aware", "replicas": 3}))


@pytest.mark.parametrize("obj", ALL, ids=lambda o: o["kind"])
def test_router_manifest_is_valid(obj: dict[str, Any]) -> None:
    kind = obj["kind"]
    if kind in CRD_KIND_SCHEMAS:
        jsonschema.Draft7Validator(load_json_schema(CRD_KIND_SCHEMAS[kind])).validate(obj)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
