"""Multi-GPU pods: resources.gpu.count > 1 renders --tensor-parallel-size and the GPU request, and the
spec is no longer refused for it."""

from __future__ import annotations

from kubeinfer_operator.render import render_deployment
from kubeinfer_operator.spec import InferenceModel, semantic_errors
from op_testlib import inference_model


def _deployment_container(spec: dict) -> tuple[InferenceModel, dict]:
    doc = inference_model(spec, name="big", namespace="ml")
    doc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    im = InferenceModel.from_manifest(doc)
    pod = render_deployment(im)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    c["_pod_volumes"] = pod["volumes"]
    return im, c


def test_multi_gpu_renders_tensor_parallel_size() -> None:
    im, c = _deployment_container(
        {
            "model": {"uri": "hf://org/model"},
            "engine": {"tensorParallelSize": 4},
            "resources": {"gpu": {"count": 4}},
        }
    )
    assert semantic_errors(im.spec) == []
    args = c["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "4"
    # the ranks' shared-memory transport (gloo/NCCL) needs a real /dev/shm, not the runtime's 64Mi
    shm = {v["name"]: v for v in c["_pod_volumes"]}["dshm"]
    # unset spec.pod.shmSize: 2Gi per GPU (NCCL's intra-node staging), 1Gi for one GPU
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_single_device_renders_no_tensor_parallel_flag() -> None:
    _, c = _deployment_container({"model": {"uri": "hf://org/model"}, "resources": {"gpu": {"count": 1}}})
    assert "--tensor-parallel-size" not in c["args"]


def test_shm_size_follows_the_gpu_count_unless_set() -> None:
    def shm(spec: dict) -> str:
        _, c = _deployment_container({"model": {"uri": "hf://org/model"}, **spec})
        return str({v["name"]: v for v in c["_pod_volumes"]}["dshm"]["emptyDir"]["sizeLimit"])

    assert shm({"resources": {"gpu": {"count": 0}}}) == "1Gi"
    assert shm({}) == "1Gi"  # one GPU
    assert shm({"engine": {"tensorParallelSize": 2}, "resources": {"gpu": {"count": 2}}}) == "4Gi"
    explicit = {
        "engine": {"tensorParallelSize": 8},
        "resources": {"gpu": {"count": 8}},
        "pod": {"shmSize": "3Gi"},
    }
    assert shm(explicit) == "3Gi"
