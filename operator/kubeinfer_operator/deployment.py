"""The model's server pods: the container's command line, environment, resources, probes, volumes
and security context, and the Deployment that runs them (lws.py turns it into a LeaderWorkerSet).
Pure functions."""

from __future__ import annotations

from typing import Any

from .adapters import lora_env, lora_pod_annotations, lora_server_args
from .cache import LoaderEstimate, model_path, server_volumes
from .common import (
    CACHE_DIR,
    CONTAINER_NAME,
    MODEL_ANNOTATION,
    RUN_AS_USER,
    SERVER_PORT,
    STARTUP_PROBE_PERIOD_SECONDS,
    TMP_DIR,
    Manifest,
    child_metadata,
    desired_replicas,
    labels,
    restricted_container_security_context,
    selector_labels,
    service_account_name,
    startup_failure_threshold,
)
from .credentials import admin_env
from .defaults import ClusterDefaults
from .gateway import gateway_server_args
from .memory import estimate_applies, pod_memory, quantity_of
from .routing import server_routing_args, server_routing_ports
from .spec import MODEL_MOUNT_ROOT, OCI_MOUNT_PATH, InferenceModel, model_location

# Seconds between the pod leaving the Service endpoints and SIGTERM, so no new request is routed to a
# draining server (kube-proxy and ingress controllers update asynchronously).
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 10


def server_args(im: InferenceModel) -> list[str]:
    spec = im.spec
    engine = spec.engine
    shared = spec.cache.shared
    args = [
        "--model",
        model_path(im) if shared else model_location(spec.model.uri).server_model,
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
        "--served-model-name",
        spec.served_name,
        "--dtype",
        engine.dtype,
        "--drain-timeout",
        str(spec.rollout.drain_timeout_seconds),
        "--log-format",
        "json",
        "--cache-dir",
        CACHE_DIR,
    ]
    if engine.quantization is not None:
        args += ["--quantize", engine.quantization]
    if engine.task != "auto":  # unset stays unrendered: existing pod templates do not change
        args += ["--task", engine.task]
    if engine.max_model_len is not None:
        args += ["--max-total-tokens", str(engine.max_model_len)]
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.max_concurrent_requests is not None:
        args += ["--max-concurrent-requests", str(engine.max_concurrent_requests)]
    if engine.tensor_parallel_size > 1:  # one rank per GPU of the pod (spec: == resources.gpu.count)
        args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    # explicit either way: the server's own default may change between images
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    if engine.speculative is not None:
        args += ["--speculative-config", engine.speculative.to_flag()]
    # LoRA flags without the adapter list, which comes from a ConfigMap (adapters.py says why)
    args += lora_server_args(im)
    return args + server_routing_args(im) + gateway_server_args(im) + list(engine.extra_args)


def _env(im: InferenceModel) -> list[dict[str, Any]]:
    spec = im.spec
    env: list[dict[str, Any]] = [
        {"name": "KUBEINFER_CACHE_DIR", "value": CACHE_DIR},
        # Hub and compiler caches must land on writable volumes: the root filesystem is read-only.
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{TMP_DIR}/triton"},
        {"name": "HOME", "value": TMP_DIR},
        {"name": "TMPDIR", "value": TMP_DIR},
    ]
    if spec.cache.shared:
        # The loader Job fetched everything: replicas get no hub token and must never reach the hub.
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    elif spec.model.revision is not None:
        env.append({"name": "MODEL_REVISION", "value": spec.model.revision})
    creds = spec.model.credentials_secret_ref
    if creds is not None and not spec.cache.shared:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": creds.name, "key": creds.key}}}
        )
    api_key = spec.engine.api_key_secret_ref
    if api_key is not None:
        env.append(
            {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": api_key.name, "key": api_key.key}}}
        )
    return env + lora_env(im) + [dict(e) for e in spec.pod.env]


# Requests when the spec sets none, so that a pod is never BestEffort (first to be evicted, no
# scheduling guarantee): about what the server needs to load a small model on CPU. The memory default
# gives way to the loader's estimate where there is one (memory.py).
DEFAULT_CPU_REQUEST = "1"
DEFAULT_MEMORY_REQUEST = "2Gi"


def _resources(im: InferenceModel, estimate: LoaderEstimate | None = None) -> dict[str, Any]:
    res = im.spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    requests["cpu"] = str(res.cpu) if res.cpu is not None else DEFAULT_CPU_REQUEST
    if estimate is not None and estimate_applies(im, estimate):
        # Known up front from the model's files: limit = request, as for an explicit value. On a GPU pod
        # the host's share (staging while loading, one runtime per rank), not the device's.
        requests["memory"] = limits["memory"] = quantity_of(pod_memory(im, estimate).host_bytes)
    elif res.memory is None:
        requests["memory"] = DEFAULT_MEMORY_REQUEST  # a request only: no limit the user did not ask for
    else:
        # Memory limit equals request: an LLM server's footprint is known up front, and overcommit
        # turns into OOM kills mid-request.
        requests["memory"] = str(res.memory)
        limits["memory"] = str(res.memory)
    if res.gpu.count > 0:
        requests[res.gpu.resource_name] = str(res.gpu.count)
        limits[res.gpu.resource_name] = str(res.gpu.count)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def termination_grace_seconds(drain_timeout_seconds: int) -> int:
    return drain_timeout_seconds + PRESTOP_SLEEP_SECONDS + TERMINATION_MARGIN_SECONDS


def shm_size_limit(im: InferenceModel) -> str:
    """`/dev/shm`'s size: spec.pod.shmSize, else 1Gi, or 2Gi per GPU for a multi-GPU pod (NCCL stages
    intra-node traffic there when GPUs lack a peer-to-peer path, and fails with "No space left on
    device" when it is short). The limit only caps: a tmpfs is charged for the pages it holds."""
    if im.spec.pod.shm_size is not None:
        return str(im.spec.pod.shm_size)
    gpus = im.spec.resources.gpu.count
    return f"{2 * gpus}Gi" if gpus > 1 else "1Gi"


def _volumes(im: InferenceModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = im.spec
    cache_volume: dict[str, Any] = {"name": "cache"}
    if spec.cache.claim_name is not None and not spec.cache.shared:
        cache_volume["persistentVolumeClaim"] = {"claimName": spec.cache.claim_name}
    else:
        empty: dict[str, Any] = {}
        if spec.cache.size_limit is not None:
            empty["sizeLimit"] = str(spec.cache.size_limit)
        cache_volume["emptyDir"] = empty
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        cache_volume,
        # PyTorch shares tensors between threads/processes through /dev/shm; the runtime default is 64Mi.
        # Sized: a memory-backed emptyDir counts against the memory limit and is unbounded otherwise.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(im)}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.cache.shared:
        # The per-pod `cache` emptyDir stays for what each server writes (built kernels).
        shared_volume, shared_mount = server_volumes(im)
        volumes.append(shared_volume)
        mounts.append(shared_mount)
    location = model_location(spec.model.uri)
    if location.claim_name is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": location.claim_name, "readOnly": True},
            }
        )
        mounts.append(
            {"name": "model", "mountPath": f"{MODEL_MOUNT_ROOT}/{location.claim_name}", "readOnly": True}
        )
    if location.scheme == "oci":
        # KEP-4639 image volume: the kubelet pulls the image (with the pod's imagePullSecrets) and
        # mounts its filesystem read-only; noexec, so nothing in it runs.
        volumes.append({"name": "model", "image": oci_volume_source(im)})
        mounts.append({"name": "model", "mountPath": OCI_MOUNT_PATH, "readOnly": True})
    volumes += [dict(v) for v in spec.pod.volumes]
    mounts += [dict(m) for m in spec.pod.volume_mounts]
    return volumes, mounts


# KEP-4639 (image volumes): alpha in 1.31, beta in 1.33 behind the ImageVolume feature gate (off),
# beta and on by default in 1.35. An older API server drops the field from the pod template (the
# gate is off), so the pods would start without their model: nothing is applied there.
IMAGE_VOLUME_MIN_VERSION = (1, 35)
IMAGE_VOLUME_UNSUPPORTED_REASON = "ImageVolumeUnsupported"


def image_volume_unsupported_message(version: tuple[int, int]) -> str:
    want = ".".join(map(str, IMAGE_VOLUME_MIN_VERSION))
    return (
        f"an oci:// model is mounted as an image volume (KEP-4639), on by default from Kubernetes {want}; "
        f"this API server is {version[0]}.{version[1]}: use hf://, s3:// or pvc://, or upgrade the cluster "
        "(nothing was applied)"
    )


def oci_volume_source(im: InferenceModel) -> dict[str, str]:
    """core/v1 ImageVolumeSource of an oci:// model: a digest is never pulled twice, a tag is checked
    at every pod start (IfNotPresent would keep serving a node's stale copy of a moved tag)."""
    reference = im.spec.model.uri.removeprefix("oci://")
    policy = "IfNotPresent" if "@sha256:" in reference else "Always"
    return {"reference": reference, "pullPolicy": policy}


def render_deployment(
    im: InferenceModel, defaults: ClusterDefaults | None = None, estimate: LoaderEstimate | None = None
) -> Manifest:
    """The model's Deployment; `estimate`: the shared-cache loader's memory estimate, which sets the
    server container's memory request and limit when the spec sets none (memory.py)."""
    defaults = defaults or ClusterDefaults()
    spec = im.spec
    volumes, mounts = _volumes(im)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.engine.image or defaults.server_image_for(spec.resources.gpu.count),
        "imagePullPolicy": "IfNotPresent",
        "args": server_args(im),
        # the admin key last: an env entry of the same name earlier in the list cannot replace it
        "env": _env(im) + admin_env(im, defaults),
        "ports": [
            {"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"},
            *server_routing_ports(im),
        ],
        "startupProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": startup_failure_threshold(spec.probes.startup_timeout_seconds),
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        # The server drains on SIGTERM itself; the sleep only covers endpoint propagation.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": restricted_container_security_context(),
        "volumeMounts": mounts,
    }
    resources = _resources(im, estimate)
    if resources:
        container["resources"] = resources

    node_selector = dict(spec.scheduling.node_selector)
    if spec.resources.gpu.count > 0 and spec.resources.gpu.product is not None:
        node_selector["nvidia.com/gpu.product"] = spec.resources.gpu.product

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            # Re-own a (cache) volume only when its root is not ours yet: a recursive chown of a large
            # model cache on every start would delay each pod by minutes.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_seconds(spec.rollout.drain_timeout_seconds),
        # The server never calls the API server, so it gets no token and no service env vars.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if spec.scheduling.tolerations:
        pod_spec["tolerations"] = list(spec.scheduling.tolerations)
    if spec.scheduling.affinity is not None:
        pod_spec["affinity"] = dict(spec.scheduling.affinity)
    if spec.scheduling.priority_class_name is not None:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    if spec.scheduling.runtime_class_name is not None:
        pod_spec["runtimeClassName"] = spec.scheduling.runtime_class_name
    if spec.scheduling.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [dict(c) for c in spec.scheduling.topology_spread_constraints]
    pod_spec["serviceAccountName"] = service_account_name(im)
    pull_secrets = defaults.pull_secrets([r.name for r in spec.pod.image_pull_secrets])
    if pull_secrets:
        pod_spec["imagePullSecrets"] = pull_secrets
    if spec.pod.env_from:
        container["envFrom"] = [dict(e) for e in spec.pod.env_from]

    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(im)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.effective_max_unavailable,
            },
        },
        # Loading weights can take as long as the startup timeout; only after that is a rollout stuck.
        "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + 300,
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {
                "labels": {**spec.pod.labels, **labels(im)},
                "annotations": {
                    **spec.pod.annotations,
                    **lora_pod_annotations(im),
                    MODEL_ANNOTATION: im.name,
                },
            },
            "spec": pod_spec,
        },
    }
    if not spec.replicas_delegated:
        deployment_spec["replicas"] = desired_replicas(im)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(im),
        "spec": deployment_spec,
    }
