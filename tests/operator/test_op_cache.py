"""The shared model cache (cache.mode Shared, issue 21 item 6): the claim and loader Job the operator
renders (kubernetes-validate --strict), the API server's refusals of edits to them (kmock gives the
real 422s: a Job's template is immutable, a claim's spec too except a larger size), and the operator
against kmock: no Deployment before the loader Job has succeeded, then one that mounts the cache
read-only; a failed Job is a Failed cache with its reason; a new revision is a new Job; an adopted
claim whose access modes cannot serve the replicas is reported, never left on Multi-Attach."""

from __future__ import annotations

import copy
import urllib.error
from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator import cache as model_cache
from kubeinfer_operator.adapters import lora_modules_value
from kubeinfer_operator.render import render_all
from kubeinfer_operator.spec import InferenceModel
from op_apichecks import api_errors
from op_cluster import MockCluster, condition, wait_for
from op_testlib import K8S_VERSIONS, inference_model

UID = "0c7d5e4a-1111-4222-8333-944445555666"
SHARED = {"mode": "Shared", "size": "20Gi", "storageClassName": "nfs-client"}


def spec(**extra: Any) -> dict[str, Any]:
    return {
        "model": {
            "uri": "hf://org/model",
            "revision": "v1",
            "credentialsSecretRef": {"name": "hf-token"},
        },
        "cache": dict(SHARED),
        **extra,
    }


def model(doc_spec: dict[str, Any], name: str = "llm") -> InferenceModel:
    doc = inference_model(doc_spec, name=name)
    doc["metadata"]["uid"] = UID
    return InferenceModel.from_manifest(doc)


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


# ---------------------------------------------------------------- render


def test_render_claim_job_and_read_only_deployment() -> None:
    im = model(spec(adapters=[{"name": "sql", "uri": "hf://org/sql-lora"}]))
    objs = by_kind(render_all(im).objects)
    for kind in ("PersistentVolumeClaim", "Job", "Deployment"):
        assert api_errors(objs[kind]) == [], kind
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(objs[kind], version, strict=True)

    claim = objs["PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "llm-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "nfs-client"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == UID

    job = objs["Job"]
    assert job["metadata"]["name"] == model_cache.job_name(im) and len(job["metadata"]["name"]) <= 63
    assert job["spec"]["backoffLimit"] == 4
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (loader,) = pod["containers"]
    assert loader["command"] == ["python", "-m", "server.download"]
    args = loader["args"]
    assert args[args.index("--model") + 1] == "org/model"
    assert args[args.index("--revision") + 1] == "v1"  # pinned
    assert args[args.index("--output") + 1] == "/var/cache/kubeinfer/models/org--model@v1"
    assert args[args.index("--adapter") + 1] == "org/sql-lora=/var/cache/kubeinfer/adapters/org--sql-lora"
    token = next(e for e in loader["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert loader["terminationMessagePolicy"] == "FallbackToLogsOnError"
    cache_vol = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache_vol["persistentVolumeClaim"] == {"claimName": "llm-cache"}  # the loader writes
    # The loader's pods are not the server's: the Service and PDB never select them.
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "kubeinfer-cache-loader"

    dep = objs["Deployment"]
    pod_spec = dep["spec"]["template"]["spec"]
    shared = next(v for v in pod_spec["volumes"] if v["name"] == "model-cache")
    assert shared["persistentVolumeClaim"] == {"claimName": "llm-cache", "readOnly": True}
    (server,) = pod_spec["containers"]
    mount = next(m for m in server["volumeMounts"] if m["name"] == "model-cache")
    assert mount == {"name": "model-cache", "mountPath": "/var/cache/kubeinfer-shared", "readOnly": True}
    sargs = server["args"]
    assert sargs[sargs.index("--model") + 1] == "/var/cache/kubeinfer-shared/models/org--model@v1"
    # the adapter list reaches the server through the adapters ConfigMap (adapters.py), read-only paths
    assert "--lora-modules" not in sargs
    assert lora_modules_value(im) == "sql=/var/cache/kubeinfer-shared/adapters/org--sql-lora"
    env = {e["name"]: e for e in server["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert "HF_TOKEN" not in env and "MODEL_REVISION" not in env  # replicas never reach the hub


def test_adopted_claim_is_not_rendered_and_the_job_mounts_it() -> None:
    im = model(spec(cache={"mode": "Shared", "claimName": "team-models"}))
    objs = by_kind(render_all(im).objects)
    assert "PersistentVolumeClaim" not in objs
    vols = objs["Job"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "team-models"}} in vols


def test_no_deployment_or_autoscaler_until_the_cache_is_ready() -> None:
    im = model(spec(scaling={"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 3}))
    waiting = render_all(im, cache_ready=False)
    kinds = {o["kind"] for o in waiting.objects}
    assert "Deployment" not in kinds and "HorizontalPodAutoscaler" not in kinds
    assert {"PersistentVolumeClaim", "Job", "Service"} <= kinds
    # not "absent" either: a Deployment serving an earlier revision is left alone meanwhile
    assert all(ref.kind not in ("Deployment", "HorizontalPodAutoscaler") for ref in waiting.absent)


def test_a_new_revision_is_a_new_job() -> None:
    a, b = model(spec()), model({**spec(), "model": {"uri": "hf://org/model", "revision": "v2"}})
    assert model_cache.job_name(a) != model_cache.job_name(b)
    long = model(spec(), name="x" * 63)
    assert len(model_cache.job_name(long)) <= 63


def _job(conditions: list[dict[str, Any]] | None = None, failed: int = 0) -> dict[str, Any]:
    return {"status": {"conditions": conditions or [], "failed": failed}}


def test_judge_the_cache_from_claim_job_and_pods() -> None:
    im = model(spec())
    claim = {"spec": {"accessModes": ["ReadWriteMany"]}}
    assert model_cache.judge(im, claim, None).reason == "LoaderPending"
    loading = model_cache.judge(im, claim, _job(failed=1))
    assert loading.phase == "Loading" and "attempt 2 of 5" in loading.message
    unbound = {
        "metadata": {"name": "llm-load-x"},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "pod has unbound immediate PersistentVolumeClaims",
                }
            ]
        },
    }
    stuck = model_cache.judge(im, claim, _job(), [unbound])
    assert stuck.reason == "Unschedulable" and "unbound immediate" in stuck.message
    done = model_cache.judge(im, claim, _job([{"type": "Complete", "status": "True"}]))
    assert done.ready and done.claim_name == "llm-cache"


def test_an_adopted_claim_is_judged_by_its_access_modes() -> None:
    two = model(spec(cache={"mode": "Shared", "claimName": "c"}, scaling={"replicas": 2}))
    rwo = {"spec": {"accessModes": ["ReadWriteMany"]}, "status": {"accessModes": ["ReadWriteOnce"]}}
    state = model_cache.judge(two, rwo, None)
    assert (state.phase, state.reason) == ("Failed", "AccessModeConflict")
    assert "Multi-Attach" in state.message and "ReadWriteOnce" in state.message
    one = model(spec(cache={"mode": "Shared", "claimName": "c"}, rollout={"maxSurge": 0}))
    assert model_cache.judge(one, rwo, None).reason == "LoaderPending"
    rox = {"spec": {"accessModes": ["ReadOnlyMany"]}}
    assert model_cache.judge(one, rox, None).reason == "AccessModeConflict"  # the loader cannot write
    assert model_cache.judge(one, None, None).reason == "ClaimNotFound"


# ---------------------------------------------------------------- kmock: the API server's refusals


def _status_code(fn: Any) -> int:
    try:
        fn()
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    return 200


def test_kmock_refuses_edits_the_api_server_refuses(cluster: MockCluster) -> None:
    objs = by_kind(render_all(model(spec())).objects)
    job, claim = objs["Job"], objs["PersistentVolumeClaim"]
    for obj in (job, claim):
        obj["metadata"].pop("ownerReferences")
        cluster.apply(obj["kind"], obj, "test")
    # Re-applying the same Job is fine; a changed pod template is a 422.
    assert _status_code(lambda: cluster.apply("Job", job, "test")) == 200
    changed = copy.deepcopy(job)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "ghcr.io/kubeinfer/server:0.2.0"
    assert _status_code(lambda: cluster.apply("Job", changed, "test")) == 422
    # A claim grows in place; it never shrinks or changes class.
    grown = {**claim, "spec": {**claim["spec"], "resources": {"requests": {"storage": "40Gi"}}}}
    assert _status_code(lambda: cluster.apply("PersistentVolumeClaim", grown, "test")) == 200
    shrunk = {**claim, "spec": {**claim["spec"], "resources": {"requests": {"storage": "10Gi"}}}}
    assert _status_code(lambda: cluster.apply("PersistentVolumeClaim", shrunk, "test")) == 422
    moved = {**grown, "spec": {**grown["spec"], "storageClassName": "other"}}
    assert _status_code(lambda: cluster.apply("PersistentVolumeClaim", moved, "test")) == 422


# ---------------------------------------------------------------- the operator against kmock


def _status(cluster: MockCluster, name: str = "llm") -> dict[str, Any]:
    return (cluster.get("InferenceModel", name) or {}).get("status") or {}


def _cache_phase(cluster: MockCluster, phase: str, name: str = "llm") -> Any:
    return wait_for(
        lambda: (_status(cluster, name).get("cache") or {}).get("phase") == phase and _status(cluster, name),
        timeout=90,
        what=f"status.cache.phase {phase}",
    )


def _finish(cluster: MockCluster, job: str, ctype: str, reason: str = "", message: str = "") -> None:
    """Play the Job controller."""
    cond = {"type": ctype, "status": "True", "reason": reason, "message": message}
    counts = {"succeeded": 1} if ctype == "Complete" else {"failed": 5}
    cluster.patch("Job", job, {"status": {"conditions": [cond], **counts}}, subresource="status")


def _events(cluster: MockCluster, reason: str, name: str = "llm") -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.live("Event")
        if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == reason
    ]


def test_deployment_waits_for_the_loader_then_mounts_the_cache_read_only(
    cluster: MockCluster, operator: Any
) -> None:
    cluster.create("InferenceModel", inference_model(spec(), name="llm"))
    st = _cache_phase(cluster, "Loading")
    job_name = st["cache"]["jobName"]
    assert cluster.get("Job", job_name) is not None and cluster.get("PersistentVolumeClaim", "llm-cache")
    assert cluster.get("Service", "llm") is not None
    assert cluster.get("Deployment", "llm") is None  # not before the cache is filled
    assert condition(cluster.get("InferenceModel", "llm"), "CacheReady")["status"] == "False"  # type: ignore[index]
    assert st["phase"] == "Pending"

    _finish(cluster, job_name, "Complete")
    dep = wait_for(lambda: cluster.get("Deployment", "llm"), timeout=90, what="the Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "llm-cache", "readOnly": True},
    } in pod["volumes"]
    assert any(m.get("readOnly") for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model-cache")
    ready = _cache_phase(cluster, "Ready")
    assert condition({"status": ready}, "CacheReady")["status"] == "True"  # type: ignore[index]
    wait_for(lambda: _events(cluster, "Loaded"), what="a Loaded event")

    # A new revision: a new loader Job (the old one deleted, never edited: its template is
    # immutable); the Deployment keeps the old revision until the new Job has succeeded.
    patched = spec()
    patched["model"]["revision"] = "v2"
    cluster.patch("InferenceModel", "llm", {"spec": {"model": patched["model"]}})
    st2 = _cache_phase(cluster, "Loading")
    new_job = st2["cache"]["jobName"]
    assert new_job != job_name
    wait_for(lambda: cluster.get("Job", job_name) is None, timeout=90, what="the old Job deleted")
    args = cluster.get("Deployment", "llm")["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    assert "/var/cache/kubeinfer-shared/models/org--model@v1" in args
    _finish(cluster, new_job, "Complete")
    wait_for(
        lambda: (
            "/var/cache/kubeinfer-shared/models/org--model@v2"
            in cluster.get("Deployment", "llm")["spec"]["template"]["spec"]["containers"][0]["args"]
        ),  # type: ignore[index]
        timeout=90,
        what="the Deployment on v2",
    )
    degraded = condition(cluster.get("InferenceModel", "llm"), "Degraded") or {}
    assert degraded.get("reason") != "ApplyFailed", degraded


def test_a_failed_loader_is_a_failed_cache_with_its_reason(cluster: MockCluster, operator: Any) -> None:
    cluster.create("InferenceModel", inference_model(spec(), name="llm"))
    st = _cache_phase(cluster, "Loading")
    job_name = st["cache"]["jobName"]
    # The last attempt's pod, its log tail as termination message (FallbackToLogsOnError).
    cluster.create(
        "Pod",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{job_name}-abcde", "labels": {model_cache.JOB_NAME_LABEL: job_name}},
            "spec": {"containers": [{"name": "loader", "image": "x"}]},
            "status": {
                "containerStatuses": [
                    {
                        "name": "loader",
                        "state": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "finishedAt": "2026-11-30T21:00:00Z",
                                "message": "download failed: --model org/model: 401 Unauthorized",
                            }
                        },
                    }
                ]
            },
        },
    )
    _finish(
        cluster, job_name, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    )
    failed = _cache_phase(cluster, "Failed")
    assert failed["cache"]["reason"] == "BackoffLimitExceeded"
    assert "backoff limit" in failed["cache"]["message"] and "401 Unauthorized" in failed["cache"]["message"]
    ready = condition({"status": failed}, "CacheReady") or {}
    assert (ready["status"], ready["reason"]) == ("False", "BackoffLimitExceeded")
    degraded = condition({"status": failed}, "Degraded") or {}
    assert (degraded["status"], degraded["reason"]) == ("True", "BackoffLimitExceeded")
    assert failed["phase"] == "Degraded"
    assert cluster.get("Deployment", "llm") is None
    (event, *_) = wait_for(lambda: _events(cluster, "BackoffLimitExceeded"), what="a Warning event")
    assert event["type"] == "Warning"


def test_an_adopted_claim_that_cannot_serve_the_replicas_is_reported(
    cluster: MockCluster, operator: Any
) -> None:
    adopted = spec(cache={"mode": "Shared", "claimName": "team-models"}, scaling={"replicas": 2})
    cluster.create("InferenceModel", inference_model(adopted, name="llm"))
    st = _cache_phase(cluster, "Pending")
    assert st["cache"]["reason"] == "ClaimNotFound"
    # The claim appears (bound ReadWriteOnce): reported at the next resync, no loader, no Deployment.
    cluster.create(
        "PersistentVolumeClaim",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "team-models"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}},
            "status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"]},
        },
    )
    failed = _cache_phase(cluster, "Failed")
    assert failed["cache"]["reason"] == "AccessModeConflict" and "Multi-Attach" in failed["cache"]["message"]
    assert (condition({"status": failed}, "CacheReady") or {}).get("reason") == "AccessModeConflict"
    assert cluster.live("Job") == [] and cluster.get("Deployment", "llm") is None
    # One replica without surge fits a ReadWriteOnce claim: the loader starts.
    cluster.patch("InferenceModel", "llm", {"spec": {"scaling": {"replicas": 1}, "rollout": {"maxSurge": 0}}})
    _cache_phase(cluster, "Loading")
    assert len(cluster.live("Job")) == 1


@pytest.mark.parametrize("mode", ["PerPod"])
def test_models_without_a_shared_cache_make_no_cache_objects(mode: str) -> None:
    objs = render_all(model({"model": {"uri": "hf://org/model"}, "cache": {"mode": mode}})).objects
    assert not {"PersistentVolumeClaim", "Job"} & {o["kind"] for o in objs}
