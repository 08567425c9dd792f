"""Multi-node replicas (spec.parallelism.nodes > 1): the LeaderWorkerSet the operator renders, checked
against the LWS project's own CRD schema (vendored, strict), the pod templates against Kubernetes'
Pod schema, and what changes around it (Service and router pick leaders, PDB, absent children, status)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator.lws import (
    CRD_MISSING_REASON,
    DIST_PORT,
    WORKER_INDEX_LABEL,
    lws_name,
    render_leaderworkerset,
    workload_view,
)
from kubeinfer_operator.names import is_dns1035_label
from kubeinfer_operator.render import (
    Capabilities,
    ChildRef,
    render_all,
    render_pdb,
    render_service,
    selector_labels,
)
from kubeinfer_operator.routing import router_args
from kubeinfer_operator.spec import InferenceModel
from kubeinfer_operator.status import ReconcileOutcome, compute_status
from op_admission_table import LONG_NAME
from op_apichecks import api_errors
from op_testlib import K8S_VERSIONS, inference_model, lws_errors

UID = "00000000-0000-0000-0000-000000000001"
MULTI: dict[str, Any] = {
    "model": {"uri": "hf://org/big"},
    "engine": {"tensorParallelSize": 16},
    "resources": {"gpu": {"count": 8}, "memory": "900Gi"},
    "parallelism": {"nodes": 2},
    "scaling": {"replicas": 3},
    "probes": {"startupTimeoutSeconds": 3600},
}


def make(spec: dict[str, Any], name: str = "big") -> InferenceModel:
    doc = inference_model(spec, name=name, namespace="ml")
    doc["metadata"]["uid"] = UID
    return InferenceModel.from_manifest(doc)


def _server(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return dict(container)


def test_multi_node_renders_a_leaderworkerset_instead_of_a_deployment() -> None:
    im = make(MULTI)
    plan = render_all(im, Capabilities())
    kinds = [o["kind"] for o in plan.objects]
    assert "Deployment" not in kinds and kinds.count("LeaderWorkerSet") == 1
    assert ChildRef("Deployment", im.child_name) in plan.absent  # a switch from one node deletes it
    lws = next(o for o in plan.objects if o["kind"] == "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "big-lws" and lws["metadata"]["ownerReferences"][0]["uid"] == UID
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only after its workers join
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
    }

    leader, worker = _server(lwt["leaderTemplate"]), _server(lwt["workerTemplate"])
    # One command line for every pod: the server takes its role from LWS_WORKER_INDEX.
    assert leader["args"] == worker["args"]
    args = leader["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "16"  # 8 GPUs x 2 nodes
    assert not any(e["name"].startswith("LWS_") for e in leader["env"])  # LWS injects them
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # per pod
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # The leader serves the API: readiness on /ready, liveness on /health, drains behind preStop.
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert leader["startupProbe"]["httpGet"]["path"] == "/ready"
    assert leader["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "preStop" in leader["lifecycle"]
    assert {"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"} in leader["ports"]
    # A worker has no API: every probe is its own /health, loading gets the whole startup timeout.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert worker["startupProbe"]["periodSeconds"] * worker["startupProbe"]["failureThreshold"] >= 3600
    assert [p["name"] for p in worker["ports"]] == ["http"]
    assert "lifecycle" not in worker
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        assert template["metadata"]["labels"].items() >= selector_labels(im).items()
        assert template["metadata"]["annotations"]["kubeinfer.dev/inference-model"] == "big"
        assert template["spec"]["volumes"] == lwt["leaderTemplate"]["spec"]["volumes"]


def test_the_service_selects_only_leaders() -> None:
    svc = render_service(make(MULTI))
    assert svc["spec"]["selector"] == {**selector_labels(make(MULTI)), WORKER_INDEX_LABEL: "0"}
    single = make({"model": {"uri": "hf://org/m"}})
    assert WORKER_INDEX_LABEL not in render_service(single)["spec"]["selector"]


def test_the_router_discovers_only_leaders() -> None:
    args = router_args(make({**MULTI, "routing": {"enabled": True}}))
    selector = args[args.index("--selector") + 1 : args.index("--service-discovery-port")]
    assert f"{WORKER_INDEX_LABEL}=0" in selector
    assert "app.kubernetes.io/instance=big" in selector


@pytest.mark.parametrize("autoscaler", ["HPA", "KEDA"])
def test_autoscalers_scale_the_leaderworkerset(autoscaler: str) -> None:
    scaling = {
        "autoscaler": autoscaler,
        "minReplicas": 1,
        "maxReplicas": 4,
        "prometheusAddress": "http://p:9090",
    }
    im = make({**MULTI, "scaling": scaling})
    plan = render_all(im, Capabilities())
    kind = {"HPA": "HorizontalPodAutoscaler", "KEDA": "ScaledObject"}[autoscaler]
    scaler = next(o for o in plan.objects if o["kind"] == kind)
    # Through the LWS scale subresource, whose selector (status.hpaPodSelector) picks the leaders.
    assert scaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "big-lws",
    }
    lws = next(o for o in plan.objects if o["kind"] == "LeaderWorkerSet")
    assert "replicas" not in lws["spec"]  # the autoscaler owns the group count
    assert lws_errors(lws) == []


def test_pdb_keeps_at_most_one_group_down() -> None:
    # minAvailable counts pods; a group of 2 pods would make "minAvailable: 2" allow a whole group and
    # a pod of another down at once. One pod at a time takes one group down, never two.
    multi = render_pdb(make({**MULTI, "disruption": {"minAvailable": 2}}))
    assert multi["spec"]["maxUnavailable"] == 1 and "minAvailable" not in multi["spec"]
    single = render_pdb(make({"model": {"uri": "hf://org/m"}, "scaling": {"replicas": 3}}))
    assert single["spec"]["minAvailable"] == 1


def test_single_node_renders_a_deployment_and_wants_no_leaderworkerset() -> None:
    im = make({"model": {"uri": "hf://org/m"}})
    plan = render_all(im, Capabilities())
    assert "LeaderWorkerSet" not in {o["kind"] for o in plan.objects}
    assert ChildRef("LeaderWorkerSet", lws_name(im)) in plan.absent
    # Without the LWS API no LeaderWorkerSet can exist: nothing to look for.
    plan = render_all(im, Capabilities(leader_worker_set=False))
    assert all(ref.kind != "LeaderWorkerSet" for ref in plan.absent)


SHAPES = {
    "two-nodes": MULTI,
    "four-nodes-suspended": {
        **MULTI,
        "engine": {"tensorParallelSize": 4},
        "resources": {"gpu": {"count": 1}},
        "parallelism": {"nodes": 4},
        "suspend": True,
        "rollout": {"maxSurge": 0},
    },
    "everything": {
        **MULTI,
        "model": {"uri": "pvc://weights/llama-405b", "credentialsSecretRef": {"name": "hf"}},
        "engine": {"tensorParallelSize": 16, "apiKeySecretRef": {"name": "api"}},
        "resources": {"gpu": {"count": 8, "product": "NVIDIA-H100-80GB-HBM3"}},
        "routing": {"enabled": True, "policy": "kv_aware"},
        "pod": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}], "shmSize": "16Gi"},
        "scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
    },
}


@pytest.mark.parametrize("spec", SHAPES.values(), ids=SHAPES.keys())
def test_leaderworkerset_is_valid_for_the_lws_crd_and_the_api_server(spec: dict[str, Any]) -> None:
    lws = render_leaderworkerset(make(spec))
    assert lws_errors(lws) == []
    assert api_errors(lws) == []  # the LWS webhook's refusals (name, rollout, size)
    for role in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][role]
        pod = {"apiVersion": "v1", "kind": "Pod", **template}
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(pod, version, strict=True)


def test_the_vendored_schema_refuses_unknown_and_wrong_fields() -> None:
    # The check above can fail: strictness reaches into the pod templates.
    lws = render_leaderworkerset(make(MULTI))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert any("livenesProbe" in e for e in lws_errors(lws))
    lws = render_leaderworkerset(make(MULTI))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroup"
    assert any("is not one of" in e for e in lws_errors(lws))
    lws = render_leaderworkerset(make(MULTI))
    lws["spec"]["groupSize"] = 2
    assert any("groupSize" in e for e in lws_errors(lws))


@pytest.mark.parametrize("name", ["big", "llama-3.1-405b-instruct", LONG_NAME, "x" * 253])
def test_lws_names_are_valid_distinct_and_short(name: str) -> None:
    im = make(MULTI, name=name)
    derived = lws_name(im)
    assert is_dns1035_label(derived) and derived.endswith("-lws")
    assert derived != im.child_name  # the LWS controller names its headless Service after the LWS
    # LWS's worker StatefulSets are `<lws>-<group>`; their pods' revision-hash label must stay <= 63.
    assert len(f"{derived}-999-") + 10 <= 63
    assert lws_name(make(MULTI, name=name + "a")) != derived


def test_status_reads_group_counts_from_the_leaderworkerset() -> None:
    im = make(MULTI)
    lws = render_leaderworkerset(im)
    lws["metadata"]["generation"] = 4
    lws["status"] = {
        "replicas": 3,
        "readyReplicas": 2,
        "updatedReplicas": 3,
        "observedGeneration": 4,
        "hpaPodSelector": "x",
        # LWS's Progressing=False means "done", not a Deployment's "stuck"
        "conditions": [{"type": "Progressing", "status": "False", "reason": "AllGroupsReady"}],
    }
    status = compute_status(im, workload_view(lws), ReconcileOutcome(), None, "2026-11-30T00:00:00Z")
    assert (status.phase, status.replicas, status.ready_replicas) == ("Ready", 3, 2)
    conds = {c.type: c for c in status.conditions}
    assert conds["Degraded"].status == "False"
    assert conds["Progressing"].status == "True"  # 2 of 3 groups ready
    lws["status"]["readyReplicas"] = 3
    status = compute_status(im, workload_view(lws), ReconcileOutcome(), None, "2026-11-30T00:00:00Z")
    assert {c.type: c for c in status.conditions}["Progressing"].reason == "RolloutComplete"


def test_a_missing_lws_api_is_a_degraded_condition() -> None:
    outcome = ReconcileOutcome(blocked_reason=CRD_MISSING_REASON, blocked_message="install LWS")
    status = compute_status(make(MULTI), None, outcome, None, "2026-11-30T00:00:00Z")
    degraded = {c.type: c for c in status.conditions}["Degraded"]
    assert (status.phase, degraded.status, degraded.reason) == ("Degraded", "True", CRD_MISSING_REASON)
