"""Scale to zero on the operator's side: what it renders for a minReplicas-0 model (the activator, its
RBAC, the workload without a replica count, KEDA's activation trigger) and the status it reports."""

from __future__ import annotations

from typing import Any

import promql_parser
import pytest
from kubeinfer_operator.activator.__main__ import parser
from kubeinfer_operator.render import render_all
from kubeinfer_operator.render_activator import activator_name
from kubeinfer_operator.spec import InferenceModel
from kubeinfer_operator.status import ReconcileOutcome, compute_status
from op_testlib import crd_errors, inference_model

HF = {"uri": "hf://org/model"}
BUILTIN: dict[str, Any] = {
    "model": HF,
    "scaling": {"minReplicas": 0, "replicas": 2, "scaleDownDelaySeconds": 120},
}
KEDA: dict[str, Any] = {
    "model": HF,
    "scaling": {
        "autoscaler": "KEDA",
        "minReplicas": 0,
        "replicas": 0,
        "maxReplicas": 4,
        "prometheusAddress": "http://prom:9090",
    },
}


def make(spec: dict[str, Any]) -> InferenceModel:
    doc = inference_model(spec, name="llm", namespace="ml")
    doc["metadata"] |= {"uid": "u1", "generation": 3}
    assert crd_errors(doc) == []
    return InferenceModel.from_manifest(doc)


def by_kind_name(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render_all(make(spec)).objects}


def activator_argv(objs: dict[tuple[str, str], dict[str, Any]]) -> Any:
    dep = objs[("Deployment", "llm-activator")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "kubeinfer_operator.activator"]
    return parser().parse_args(container["args"])  # the flags the activator really parses


def test_builtin_scale_to_zero_renders_the_activator_and_leaves_the_replica_count_to_it() -> None:
    objs = by_kind_name(BUILTIN)
    assert "replicas" not in objs[("Deployment", "llm")]["spec"]  # the activator's, via /scale
    args = activator_argv(objs)
    assert (args.namespace, args.name, args.kind) == ("ml", "llm", "Deployment")
    assert args.upstream == "http://llm.ml.svc:8080"
    assert (args.max_held_requests, args.max_wait_seconds) == (100, 1800)  # probes.startupTimeoutSeconds
    assert (args.wake, args.wake_replicas, args.scale_down_delay_seconds, args.idle_scale_down) == (
        True,
        2,
        120,
        True,
    )
    assert args.max_concurrent_requests == 128  # the server's default --max-concurrent-requests
    role = objs[("Role", "llm-activator")]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["llm"], "verbs": ["get"]},
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["llm"],
            "verbs": ["get", "patch"],
        },
    ]
    binding = objs[("RoleBinding", "llm-activator")]
    assert binding["subjects"][0]["name"] == "llm-activator"
    assert objs[("Service", "llm-activator")]["spec"]["ports"][0]["port"] == 8000
    assert ("ServiceMonitor", "llm-activator") in objs


def test_bounds_and_routing_reach_the_activator() -> None:
    spec = {
        **BUILTIN,
        "scaling": {**BUILTIN["scaling"], "maxHeldRequests": 7, "maxWaitSeconds": 90},
        "engine": {"maxConcurrentRequests": 3},
        "routing": {"enabled": True},
    }
    args = activator_argv(by_kind_name(spec))
    assert (args.max_held_requests, args.max_wait_seconds, args.max_concurrent_requests) == (7, 90, 3)
    assert args.upstream == "http://llm-router.ml.svc:8000"


def test_multi_node_models_scale_their_leaderworkerset() -> None:
    objs = by_kind_name(
        {
            **BUILTIN,
            "resources": {"gpu": {"count": 1}},
            "parallelism": {"nodes": 2},
            "engine": {"tensorParallelSize": 2},
        }
    )
    lws = next(o for (k, _), o in objs.items() if k == "LeaderWorkerSet")
    assert "replicas" not in lws["spec"]
    args = activator_argv(objs)
    assert (args.kind, args.name) == ("LeaderWorkerSet", lws["metadata"]["name"])
    rules = objs[("Role", "llm-activator")]["rules"]
    assert [r["resources"] for r in rules] == [["leaderworkersets"], ["leaderworkersets/scale"]]
    assert all(r["resourceNames"] == [lws["metadata"]["name"]] for r in rules)


def test_keda_wakes_on_the_activators_metric_and_scales_down_itself() -> None:
    objs = by_kind_name(KEDA)
    args = activator_argv(objs)
    assert (args.idle_scale_down, args.wake, args.wake_replicas) == (False, False, 1)
    # It only reads the workload: KEDA owns the count, from zero too.
    assert [r["resources"] for r in objs[("Role", "llm-activator")]["rules"]] == [["deployments"]]
    so = objs[("ScaledObject", "llm")]
    assert so["spec"]["minReplicaCount"] == 0
    trigger = so["spec"]["triggers"][-1]
    assert trigger["metadata"]["activationThreshold"] == "0"
    expr: Any = promql_parser.parse(trigger["metadata"]["query"])
    selector: Any = expr.expr
    assert selector.name == "kubeinfer_activator_pending"
    matchers = {m.name: m.value for m in selector.matchers.matchers}
    assert matchers == {"namespace": "ml", "service": "llm-activator", "model_name": "llm"}


@pytest.mark.parametrize(
    "spec",
    [
        {"model": HF, "scaling": {"replicas": 2}},
        {"model": HF, "scaling": {"minReplicas": 0, "replicas": 0}},  # a fixed zero: nothing to wake
        {**BUILTIN, "suspend": True},
    ],
)
def test_no_activator_without_scale_to_zero_and_a_stale_one_is_deleted(spec: dict[str, Any]) -> None:
    plan = render_all(make(spec))
    assert not any(o["metadata"]["name"] == "llm-activator" for o in plan.objects)
    assert {r.kind for r in plan.absent if r.name == activator_name(make(spec))} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "ServiceMonitor",
        "NetworkPolicy",
    }


def _workload(spec_replicas: int, replicas: int, ready: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": spec_replicas},
        "status": {
            "observedGeneration": 2,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
        },
    }


def test_status_tells_scaled_to_zero_then_waking_then_ready() -> None:
    im = make(BUILTIN)
    ready = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "ReplicasReady", "lastTransitionTime": "t"}
        ]
    }
    at_zero = compute_status(im, _workload(0, 0, 0), ReconcileOutcome(), ready, "t1")
    assert at_zero.phase == "ScaledToZero"
    assert at_zero.endpoint == "http://llm-activator.ml.svc:8000"  # where clients call it
    # Woken after serving before: Waking, not Degraded/NoReadyReplicas.
    waking = compute_status(im, _workload(2, 2, 0), ReconcileOutcome(), ready, "t2")
    assert waking.phase == "Waking"
    assert {c.type: c.reason for c in waking.conditions}["Degraded"] == "AsExpected"
    assert compute_status(im, _workload(2, 2, 1), ReconcileOutcome(), ready, "t3").phase == "Ready"
    # A model that does not scale to zero and lost its replicas is still Degraded.
    fixed = make({"model": HF, "scaling": {"replicas": 2}})
    assert compute_status(fixed, _workload(2, 2, 0), ReconcileOutcome(), ready, "t2").phase == "Degraded"
