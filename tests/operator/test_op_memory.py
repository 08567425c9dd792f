"""The pods' memory from the model (issue 44 item 4): the shared-cache loader Job writes the model's
memory estimate (server/memory_estimate.py) as its termination message, the operator reads it from the
finished pod, keeps it in status.memoryEstimate (a deleted loader pod changes nothing; a changed model
drops it) and sets the server pods' memory request and limit from it: a CPU pod's whole footprint, a GPU
pod's host share (its slice of the checkpoint staged while loading, one runtime per rank; memory.py),
every pod of a multi-node group alike. Without one (no loader, an old loader image) the default 2Gi
request stays; an explicit resources.memory always wins, with a Warning Event and MemorySufficient=False
when it is below the estimate."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from kubeinfer_operator import cache as model_cache
from kubeinfer_operator import memory
from kubeinfer_operator.deployment import DEFAULT_MEMORY_REQUEST, render_deployment
from kubeinfer_operator.lws import render_leaderworkerset
from kubeinfer_operator.render import render_all
from kubeinfer_operator.spec import InferenceModel
from op_cluster import MockCluster, condition, wait_for
from op_testlib import inference_model
from test_op_cache import _cache_phase, _events, _finish, _status, spec

GIB = 2**30
ESTIMATE = {
    "source": "safetensors",
    "total_bytes": 5 * GIB + 123,
    "minimum_bytes": 3 * GIB,
    "weight_bytes": 2 * GIB + 5,
    "kv_cache_bytes": 512 * 2**20,
}


CPU = {"gpu": {"count": 0}}


def cpu_spec(**extra: Any) -> dict[str, Any]:
    """A CPU model (the CRD's default is one GPU) on a shared cache."""
    return spec(**{"resources": dict(CPU), **extra})


def model(doc_spec: dict[str, Any]) -> InferenceModel:
    return InferenceModel.from_manifest(inference_model(doc_spec, name="llm"))


def loader_pod(
    job: str, message: str, exit_code: int = 0, finished: str = "2026-12-04T10:00:00Z"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{finished[-9:-7]}{exit_code}",
            "labels": {model_cache.JOB_NAME_LABEL: job},
        },
        "spec": {"containers": [{"name": "loader", "image": "x"}]},
        "status": {
            "containerStatuses": [
                {
                    "name": "loader",
                    "state": {
                        "terminated": {"exitCode": exit_code, "finishedAt": finished, "message": message}
                    },
                }
            ]
        },
    }


def _memory(dep: dict[str, Any]) -> tuple[Any, Any]:
    res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    return res["requests"].get("memory"), (res.get("limits") or {}).get("memory")


def test_the_loader_job_writes_the_estimate_for_the_serving_flags() -> None:
    im = model(cpu_spec(engine={"maxModelLen": 4096, "maxNumSeqs": 8, "dtype": "bfloat16"}))
    container = model_cache.render_job(im)["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--memory-estimate-file") + 1] == container["terminationMessagePath"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # failures: the log's tail
    pairs = dict(itertools.pairwise(args))
    assert pairs["--max-model-len"] == "4096" and pairs["--max-num-seqs"] == "8"
    assert pairs["--dtype"] == "bfloat16" and pairs["--device"] == "cpu"
    # another context length is another estimate: a new Job
    other = model(cpu_spec(engine={"maxModelLen": 8192, "maxNumSeqs": 8, "dtype": "bfloat16"}))
    assert model_cache.job_name(other) != model_cache.job_name(im)


def test_a_changed_estimate_method_is_a_new_loader_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator whose loader estimates the same flags differently (ESTIMATE_VERSION) runs a new Job, so
    a model estimated by the older loader (a GGUF's k-quants at the repacks' bits) gets the new figure."""
    im = model(cpu_spec())
    before = model_cache.job_name(im)
    monkeypatch.setattr(model_cache, "ESTIMATE_VERSION", model_cache.ESTIMATE_VERSION + 1)
    assert model_cache.job_name(im) != before


def test_the_loader_job_gets_the_step_flags_set_through_extra_args() -> None:
    """--block-size and --max-num-batched-tokens change the estimate (whole blocks; a windowed layer's
    chunk): set in engine.extraArgs in either form, the loader gets them as the server does, and a
    change makes a new Job; other extraArgs do not reach the loader."""
    im = model(
        cpu_spec(
            engine={
                "extraArgs": ["--block-size=32", "--max-num-batched-tokens", "512", "--burst-itl-seconds=1"]
            }
        )
    )
    args = model_cache.render_job(im)["spec"]["template"]["spec"]["containers"][0]["args"]
    pairs = dict(itertools.pairwise(args))
    assert pairs["--block-size"] == "32" and pairs["--max-num-batched-tokens"] == "512"
    assert not any(a.startswith("--burst-itl-seconds") for a in args)
    other = model(cpu_spec(engine={"extraArgs": ["--block-size=32", "--max-num-batched-tokens=1024"]}))
    assert model_cache.job_name(other) != model_cache.job_name(im)


def test_the_estimate_is_read_from_the_newest_successful_loader_pod() -> None:
    old = loader_pod("j", json.dumps({**ESTIMATE, "total_bytes": GIB}), finished="2026-12-04T09:00:00Z")
    new = loader_pod("j", json.dumps(ESTIMATE))
    failed = loader_pod("j", "download failed: x", exit_code=1, finished="2026-12-04T11:00:00Z")
    got = model_cache.loader_estimate([old, failed, new])
    assert got == model_cache.LoaderEstimate(
        5 * GIB + 123, 3 * GIB, 2 * GIB + 5, 512 * 2**20, 0, "safetensors"
    )
    assert got.runtime_bytes == 5 * GIB + 123 - (2 * GIB + 5) - 512 * 2**20
    assert model_cache.loader_estimate([failed]) is None
    assert model_cache.loader_estimate([loader_pod("j", "done")]) is None  # an old loader's log tail
    assert model_cache.loader_estimate([loader_pod("j", json.dumps({**ESTIMATE, "total_bytes": -1}))]) is None
    assert model_cache.loader_estimate([loader_pod("j", json.dumps({"total_bytes": 1}))]) is None


def test_render_with_and_without_an_estimate() -> None:
    est = model_cache.loader_estimate([loader_pod("j", json.dumps(ESTIMATE))])
    im = model(cpu_spec())
    # without an estimate: the default request, no limit
    assert _memory(render_deployment(im)) == (DEFAULT_MEMORY_REQUEST, None)
    # with one: request = limit = the total rounded up to MiB (5 GiB + 123 bytes -> 5121Mi)
    assert _memory(render_deployment(im, estimate=est)) == ("5121Mi", "5121Mi")
    plan = {o["kind"]: o for o in render_all(im, estimate=est).objects}
    assert _memory(plan["Deployment"]) == ("5121Mi", "5121Mi")
    # the user's value wins, however small
    explicit = model(cpu_spec(resources={**CPU, "memory": "1Gi"}))
    assert _memory(render_deployment(explicit, estimate=est)) == ("1Gi", "1Gi")
    # a GPU pod: the host's share (the checkpoint staged while loading + the runtime), not the default
    gpu = model(spec(resources={"gpu": {"count": 1}}))
    host = 2 * GIB + 5 + est.runtime_bytes if est else 0
    assert _memory(render_deployment(gpu, estimate=est)) == (memory.quantity_of(host),) * 2
    gpu_args = model_cache.render_job(gpu)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gpu_args[gpu_args.index("--device") + 1] == "cuda"


@pytest.mark.usefixtures("operator")
def test_operator_sets_the_deployment_s_memory_from_the_loader_s_estimate(cluster: MockCluster) -> None:
    cluster.create("InferenceModel", inference_model(cpu_spec(), name="llm"))
    job = _cache_phase(cluster, "Loading")["cache"]["jobName"]
    cluster.create("Pod", loader_pod(job, json.dumps(ESTIMATE)))
    _finish(cluster, job, "Complete")
    dep = wait_for(lambda: cluster.get("Deployment", "llm"), timeout=90, what="the Deployment")
    assert _memory(dep) == ("5121Mi", "5121Mi")


# A real-shape estimate: 16 GB of bf16 weights stored as fp32 (32 GB in the files), 2 GiB of KV.
BIG = model_cache.LoaderEstimate(
    total_bytes=16 * 10**9 + 2 * GIB + GIB,
    minimum_bytes=16 * 10**9 + GIB + 2**28,
    weight_bytes=16 * 10**9,
    kv_cache_bytes=2 * GIB,
    file_weight_bytes=32 * 10**9,
    format="safetensors",
)


def gpu_model(gpus: int, nodes: int = 1, **resources: Any) -> InferenceModel:
    return model(
        spec(
            resources={"gpu": {"count": gpus}, **resources},
            parallelism={"nodes": nodes},
            engine={"tensorParallelSize": gpus * nodes},
        )
    )


def test_what_the_estimate_means_per_pod_on_cpu_gpu_and_several_nodes() -> None:
    cpu = memory.pod_memory(model(cpu_spec()), BIG)
    assert cpu == memory.PodMemory(BIG.total_bytes, None)  # one process holds it all
    one = memory.pod_memory(gpu_model(1), BIG)
    # the rank reads the checkpoint as stored (fp32 here) before moving it to the GPU; one runtime
    assert one == memory.PodMemory(32 * 10**9 + GIB, 16 * 10**9 + 2 * GIB)
    four = memory.pod_memory(gpu_model(4), BIG)
    # four ranks in the pod: four runtimes, each GPU a quarter of the weights and its own KV allocation
    assert four == memory.PodMemory(32 * 10**9 + 4 * GIB, 4 * 10**9 + 2 * GIB)
    group = memory.pod_memory(gpu_model(4, nodes=2), BIG)
    # each of the group's 2 pods stages half the checkpoint; 8 ranks share the weights
    assert group == memory.PodMemory(16 * 10**9 + 4 * GIB, 2 * 10**9 + 2 * GIB)
    # a GGUF (kept blocks): nothing wider than the resident size is staged
    gguf = model_cache.LoaderEstimate(5 * GIB, 4 * GIB, 3 * GIB, GIB, 2 * GIB, "gguf")
    assert memory.pod_memory(gpu_model(1), gguf).host_bytes == 3 * GIB + GIB


def test_every_pod_of_a_multi_node_group_gets_its_share() -> None:
    im = gpu_model(4, nodes=2)
    lws = render_leaderworkerset(im, estimate=BIG)
    template = lws["spec"]["leaderWorkerTemplate"]
    want = memory.quantity_of(16 * 10**9 + 4 * GIB)
    for role in ("leaderTemplate", "workerTemplate"):
        res = template[role]["spec"]["containers"][0]["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == want, role
        assert res["limits"]["nvidia.com/gpu"] == "4"
    plan = {o["kind"]: o for o in render_all(im, estimate=BIG).objects}
    assert plan["LeaderWorkerSet"] == lws
    # the loader itself keeps its small request: it downloads and reads headers
    job = model_cache.render_job(im)["spec"]["template"]["spec"]["containers"][0]
    assert job["resources"] == {"requests": model_cache.LOADER_REQUESTS}


def test_status_keeps_the_estimate_of_the_current_load_only() -> None:
    im = model(cpu_spec())
    record = memory.estimate_status(im, BIG)
    status = {"memoryEstimate": record.model_dump(by_alias=True, exclude_none=True)}
    assert status["memoryEstimate"]["loaderJob"] == model_cache.job_name(im)
    assert status["memoryEstimate"]["podBytes"] == BIG.total_bytes
    assert memory.recorded_estimate(im, status) == BIG
    # another revision, another context length, GPUs instead of CPUs: another load, not this estimate
    for changed in (
        cpu_spec(model={"uri": "hf://org/model", "revision": "v2"}),
        cpu_spec(engine={"maxModelLen": 8192}),
        spec(resources={"gpu": {"count": 1}}),
    ):
        assert memory.recorded_estimate(model(changed), status) is None, changed
    # what a status edit may have left: refused, not trusted
    assert (
        memory.recorded_estimate(im, {"memoryEstimate": {**status["memoryEstimate"], "totalBytes": -1}})
        is None
    )
    assert memory.recorded_estimate(im, {"memoryEstimate": "x"}) is None
    assert memory.recorded_estimate(im, None) is None


def test_the_verdict_names_both_numbers_when_the_spec_is_below() -> None:
    applied = memory.memory_verdict(model(cpu_spec()), BIG)
    assert (applied.status, applied.reason) == ("True", "EstimateApplied")
    above = memory.memory_verdict(model(cpu_spec(resources={**CPU, "memory": "40Gi"})), BIG)
    assert (above.status, above.reason) == ("True", "AboveEstimate")
    below = memory.memory_verdict(model(cpu_spec(resources={**CPU, "memory": "17Gi"})), BIG)
    assert (below.status, below.reason) == ("False", "MemoryBelowEstimate")
    assert f"({17 * GIB} bytes)" in below.message and f"({BIG.total_bytes} bytes" in below.message
    assert "refuses to start" not in below.message  # above the minimum: it starts, with less KV
    tiny = memory.memory_verdict(model(cpu_spec(resources={**CPU, "memory": "8Gi"})), BIG)
    assert "refuses to start" in tiny.message and str(BIG.minimum_bytes) in tiny.message
    # a GPU pod is compared with its host share
    gpu = memory.memory_verdict(gpu_model(1, memory="16Gi"), BIG)
    assert gpu.reason == "MemoryBelowEstimate" and str(32 * 10**9 + GIB) in gpu.message


def _loaded_model(cluster: MockCluster, doc_spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    cluster.create("InferenceModel", inference_model(doc_spec, name="llm"))
    job = _cache_phase(cluster, "Loading")["cache"]["jobName"]
    pod = loader_pod(job, json.dumps(ESTIMATE))
    cluster.create("Pod", pod)
    _finish(cluster, job, "Complete")
    dep = wait_for(lambda: cluster.get("Deployment", "llm"), timeout=90, what="the Deployment")
    return job, dep


@pytest.mark.slow  # ~50 s at load 10, and its operator's stop took another 60 s there
@pytest.mark.usefixtures("operator")
def test_the_estimate_outlives_its_loader_pod_warns_below_and_goes_with_the_load(
    cluster: MockCluster,
) -> None:
    # One operator for the three acts (each operator start and stop costs seconds).
    job, dep = _loaded_model(cluster, cpu_spec())
    assert _memory(dep) == ("5121Mi", "5121Mi")
    kept = wait_for(lambda: _status(cluster).get("memoryEstimate"), timeout=30, what="status.memoryEstimate")
    assert kept["loaderJob"] == job and kept["totalBytes"] == ESTIMATE["total_bytes"]
    assert kept["model"] == "hf://org/model" and kept["revision"] == "v1" and kept["format"] == "safetensors"
    assert condition(cluster.get("InferenceModel", "llm"), "MemorySufficient")["reason"] == "EstimateApplied"
    # 1. the loader's pod goes (a node drained, a TTL, a person): a later reconcile still has the estimate
    for pod in cluster.live("Pod"):
        if (pod["metadata"].get("labels") or {}).get(model_cache.JOB_NAME_LABEL) == job:
            cluster.delete("Pod", pod["metadata"]["name"])
    template = dep["spec"]["template"]
    cluster.patch("InferenceModel", "llm", {"spec": {"scaling": {"replicas": 2}}})
    dep = wait_for(
        lambda: (d := cluster.get("Deployment", "llm")) and d["spec"].get("replicas") == 2 and d,
        timeout=60,
        what="the second replica",
    )
    assert _memory(dep) == ("5121Mi", "5121Mi")
    assert dep["spec"]["template"] == template  # no rollout
    assert _status(cluster)["memoryEstimate"] == kept
    # 2. an explicit value below the estimate: a Warning Event naming both numbers; the spec wins
    cluster.patch("InferenceModel", "llm", {"spec": {"resources": {"memory": "3Gi"}}})
    (event,) = wait_for(lambda: _events(cluster, "MemoryBelowEstimate"), timeout=30, what="the Warning")
    assert event["type"] == "Warning"
    assert (
        f"({3 * GIB} bytes)" in event["message"] and f"({ESTIMATE['total_bytes']} bytes" in event["message"]
    )
    cond = condition(cluster.get("InferenceModel", "llm"), "MemorySufficient")
    assert cond["status"] == "False" and cond["reason"] == "MemoryBelowEstimate"
    assert cond["message"] == event["message"]
    wait_for(
        lambda: _memory(cluster.get("Deployment", "llm") or dep) == ("3Gi", "3Gi"), timeout=30, what="3Gi"
    )
    # 3. a new revision is a new load: the old estimate no longer describes it
    cluster.patch("InferenceModel", "llm", {"spec": {"model": {"revision": "v2"}}})
    wait_for(
        lambda: "memoryEstimate" not in _status(cluster) and _status(cluster)["cache"]["jobName"] != job,
        timeout=60,
        what="the estimate dropped",
    )
    assert condition(cluster.get("InferenceModel", "llm"), "MemorySufficient") is None
