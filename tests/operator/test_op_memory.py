"""The pods' memory from the model (issue 44 item 4): the shared-cache loader Job writes the model's
memory estimate (server/memory_estimate.py) as its termination message, the operator reads it from the
finished pod and sets the Deployment's memory request and limit from it; without one (no loader, an
old loader image, a GPU pod) the default 2Gi request stays; an explicit resources.memory always wins."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from kubeinfer_operator import cache as model_cache
from kubeinfer_operator.deployment import DEFAULT_MEMORY_REQUEST, render_deployment
from kubeinfer_operator.render import render_all
from kubeinfer_operator.spec import InferenceModel
from op_cluster import MockCluster, wait_for
from op_testlib import inference_model
from test_op_cache import _cache_phase, _finish, spec

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


def test_the_estimate_is_read_from_the_newest_successful_loader_pod() -> None:
    old = loader_pod("j", json.dumps({**ESTIMATE, "total_bytes": GIB}), finished="2026-12-04T09:00:00Z")
    new = loader_pod("j", json.dumps(ESTIMATE))
    failed = loader_pod("j", "download failed: x", exit_code=1, finished="2026-12-04T11:00:00Z")
    got = model_cache.loader_estimate([old, failed, new])
    assert got == model_cache.LoaderEstimate(5 * GIB + 123, 3 * GIB, 2 * GIB + 5, 512 * 2**20)
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
    # a GPU pod's weights live in device memory: the host request stays the default
    gpu = model(spec(resources={"gpu": {"count": 1}}))
    assert _memory(render_deployment(gpu, estimate=est))[0] == DEFAULT_MEMORY_REQUEST
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
