"""What the model's memory estimate (the shared-cache loader's, server/memory_estimate.py) means for its
pods: the server container's memory request and limit on CPU and on GPU pods, one or several per replica
(docs/operator.md, "Memory"); the estimate kept in status.memoryEstimate; and the MemorySufficient
condition when an explicit resources.memory is below the estimate. Pure functions.

CPU pod: one process holds the weights, the KV cache allocation and the runtime: the estimate's total.
GPU pod (resources.gpu.count G, parallelism.nodes M, tensor parallelism N = G x M): each of the pod's G
ranks is a process (the runtime, counted once per rank) that reads its slice of every tensor into host
memory before moving it to its GPU (server/models/loader.py `load_state_dict` with a slicer), so a pod's
host peak is its 1/M share of the checkpoint as stored (at least the resident size) plus G runtimes; a
GPU holds 1/N of the resident weights plus its rank's KV cache allocation (`--kv-cache-memory`, each rank
allocating it for its own KV heads). Device memory is no pod resource: it is reported, not requested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cache import LoaderEstimate, job_name
from .quantity import parse_quantity
from .spec import InferenceModel, MemoryEstimateStatus

MIB = 2**20
GIB = 2**30
CONDITION = "MemorySufficient"
BELOW_ESTIMATE = "MemoryBelowEstimate"


@dataclass(frozen=True)
class PodMemory:
    """What one server pod of the model needs, in bytes."""

    host_bytes: int  # the server container's memory (request = limit when the estimate sets it)
    gpu_bytes: int | None  # each GPU's: its weight shard + its KV allocation; None on CPU


def pod_memory(im: InferenceModel, estimate: LoaderEstimate) -> PodMemory:
    """The per-pod figures of module docstring's rules for this spec's GPU count and nodes."""
    gpus = im.spec.resources.gpu.count
    if gpus == 0:
        return PodMemory(estimate.total_bytes, None)
    nodes = im.spec.parallelism.nodes
    ranks = im.spec.engine.tensor_parallel_size  # = gpus x nodes (admission)
    stored = max(estimate.file_weight_bytes, estimate.weight_bytes)
    host = -(-stored // nodes) + gpus * estimate.runtime_bytes
    return PodMemory(host, -(-estimate.weight_bytes // ranks) + estimate.kv_cache_bytes)


def quantity_of(size: int) -> str:
    """Bytes as a memory quantity, rounded up to whole MiB."""
    return f"{-(-size // MIB)}Mi"


def estimate_applies(im: InferenceModel, estimate: LoaderEstimate | None) -> bool:
    """The estimate sets the server pods' memory: there is one and the spec sets none."""
    return estimate is not None and im.spec.resources.memory is None


def estimate_status(im: InferenceModel, estimate: LoaderEstimate) -> MemoryEstimateStatus:
    """status.memoryEstimate: the estimate, the load it came from, and the per-pod figures."""
    pod = pod_memory(im, estimate)
    return MemoryEstimateStatus(
        loader_job=job_name(im),
        model=im.spec.model.uri,
        revision=im.spec.model.revision,
        format=estimate.format,
        total_bytes=estimate.total_bytes,
        minimum_bytes=estimate.minimum_bytes,
        weight_bytes=estimate.weight_bytes,
        file_weight_bytes=estimate.file_weight_bytes,
        kv_cache_bytes=estimate.kv_cache_bytes,
        pod_bytes=pod.host_bytes,
        gpu_bytes=pod.gpu_bytes,
    )


def recorded_estimate(im: InferenceModel, status: dict[str, Any] | None) -> LoaderEstimate | None:
    """The estimate status.memoryEstimate kept, if it belongs to the model's current load (the loader
    Job's name carries the digest of model, revision, hub adapters and estimate flags): None after a
    model change, or when there is none or it does not parse."""
    raw = (status or {}).get("memoryEstimate")
    if not isinstance(raw, dict) or raw.get("loaderJob") != job_name(im):
        return None
    keys = ("totalBytes", "minimumBytes", "weightBytes", "kvCacheBytes", "fileWeightBytes")
    values = [raw.get(k, 0) for k in keys]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        return None
    fmt = raw.get("format")
    total, minimum, weights, kv, in_files = values
    return LoaderEstimate(total, minimum, weights, kv, in_files, fmt if isinstance(fmt, str) else "")


@dataclass(frozen=True)
class MemoryVerdict:
    """The MemorySufficient condition: status "True" | "False", reason, message."""

    status: str
    reason: str
    message: str


def _gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB"


def memory_verdict(im: InferenceModel, estimate: LoaderEstimate) -> MemoryVerdict:
    """Whether the server pods' memory covers the estimate: set from it (EstimateApplied), an explicit
    resources.memory at or above it (AboveEstimate), or below it (MemoryBelowEstimate: the spec still
    wins; the message names both numbers, and on CPU says when the server will refuse to start)."""
    pod = pod_memory(im, estimate)
    need = pod.host_bytes
    what = "the estimate" if im.spec.resources.gpu.count == 0 else "the estimated host memory of each pod"
    explicit = im.spec.resources.memory
    if explicit is None:
        return MemoryVerdict(
            "True", "EstimateApplied", f"memory request and limit {quantity_of(need)}: {what} ({need} bytes)"
        )
    have = parse_quantity(explicit)
    if have is None or have >= need:
        return MemoryVerdict(
            "True", "AboveEstimate", f"resources.memory {explicit} covers {what}: {_gib(need)} ({need} bytes)"
        )
    message = (
        f"resources.memory {explicit} ({int(have)} bytes) is below {what}, {_gib(need)} ({need} bytes: "
        f"{_breakdown(im, estimate)}); the spec's value is used"
    )
    if im.spec.resources.gpu.count == 0 and have < estimate.minimum_bytes:
        message += (
            f"; it is also below the minimum {_gib(estimate.minimum_bytes)} ({estimate.minimum_bytes} bytes: "
            "weights, one max-model-len sequence's KV and the runtime), so the server refuses to start"
        )
    return MemoryVerdict("False", BELOW_ESTIMATE, message)


def _breakdown(im: InferenceModel, estimate: LoaderEstimate) -> str:
    gpus = im.spec.resources.gpu.count
    if gpus == 0:
        return (
            f"weights {estimate.weight_bytes}, KV cache {estimate.kv_cache_bytes}, "
            f"runtime {estimate.runtime_bytes}"
        )
    nodes = im.spec.parallelism.nodes
    staged = -(-max(estimate.file_weight_bytes, estimate.weight_bytes) // nodes)
    share = "the checkpoint" if nodes == 1 else f"1/{nodes} of the checkpoint"
    return f"{share} staged while loading {staged}, runtime {estimate.runtime_bytes} for each of {gpus} ranks"
