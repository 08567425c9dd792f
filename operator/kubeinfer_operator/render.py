"""Pure renderers: InferenceModel -> the Kubernetes objects the operator applies. No I/O here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .adapters import (
    configmap_name,
    lora_env,
    lora_pod_annotations,
    lora_server_args,
    render_adapters_configmap,
)
from .credentials import admin_env
from .defaults import ClusterDefaults
from .quantity import same_quantity
from .spec import (
    API_VERSION,
    KIND,
    MODEL_MOUNT_ROOT,
    InferenceModel,
    model_location,
)

Manifest = dict[str, Any]

FIELD_MANAGER = "kubeinfer-operator"
CONTAINER_NAME = "server"
SERVER_PORT = 8080
CACHE_DIR = "/var/cache/kubeinfer"
TMP_DIR = "/tmp"
# The server process runs as this uid/gid; fsGroup makes mounted volumes writable for it.
RUN_AS_USER = 65532
STARTUP_PROBE_PERIOD_SECONDS = 10
# Seconds between the pod leaving the Service endpoints and SIGTERM, so no new request is routed to a
# draining server (kube-proxy and ingress controllers update asynchronously).
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 10

METRIC_NAMES = {
    "QueueDepth": "vllm:num_requests_waiting",
    "KVCacheUsage": "vllm:kv_cache_usage_perc",
    "RunningRequests": "vllm:num_requests_running",
}


def pods_metric_name(metric: str) -> str:
    """Name of the per-pod custom metric the HPA reads (prometheus-adapter turns ':' into '_')."""
    return METRIC_NAMES[metric].replace(":", "_")


# On the pod template: the InferenceModel's own name (which need not be a valid label value), so a pod
# event leads back to its model.
MODEL_ANNOTATION = "kubeinfer.dev/inference-model"


def selector_labels(im: InferenceModel) -> dict[str, str]:
    # The derived child name: the InferenceModel's name may be 253 characters long, a label value 63.
    return {"app.kubernetes.io/name": "kubeinfer-server", "app.kubernetes.io/instance": im.child_name}


def labels(im: InferenceModel) -> dict[str, str]:
    return {
        **selector_labels(im),
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": "kubeinfer",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
    }


def serving_selector_labels(im: InferenceModel) -> dict[str, str]:
    """The pods that serve the API: all of the model's, or only the group leaders of a multi-node model."""
    from .lws import leader_selector_labels  # lws.py builds on this module

    return {**selector_labels(im), **leader_selector_labels(im)}


def selector_string(im: InferenceModel) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(im).items())


def owner_reference(im: InferenceModel) -> dict[str, Any]:
    assert im.uid is not None
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": im.name,
        "uid": im.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(im: InferenceModel, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": im.child_name,
        "namespace": im.namespace,
        "labels": {**(extra_labels or {}), **labels(im)},
    }
    if im.uid is not None:
        meta["ownerReferences"] = [owner_reference(im)]
    return meta


def child_metadata(im: InferenceModel) -> dict[str, Any]:
    """The name, namespace, labels and ownerReference every child of the model carries."""
    return _metadata(im)


def endpoint_url(im: InferenceModel) -> str:
    return f"http://{im.child_name}.{im.namespace}.svc:{SERVER_PORT}"


def server_args(im: InferenceModel) -> list[str]:
    from .cache import model_path  # cache.py builds on this module

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
    from .routing import server_routing_args  # routing.py builds on this module

    return args + server_routing_args(im) + list(engine.extra_args)


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
# scheduling guarantee): about what the server needs to load a small model on CPU.
DEFAULT_CPU_REQUEST = "1"
DEFAULT_MEMORY_REQUEST = "2Gi"


def _resources(im: InferenceModel) -> dict[str, Any]:
    res = im.spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    requests["cpu"] = str(res.cpu) if res.cpu is not None else DEFAULT_CPU_REQUEST
    if res.memory is None:
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


def startup_failure_threshold(startup_timeout_seconds: int) -> int:
    return max(1, math.ceil(startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS))


def termination_grace_seconds(drain_timeout_seconds: int) -> int:
    return drain_timeout_seconds + PRESTOP_SLEEP_SECONDS + TERMINATION_MARGIN_SECONDS


def restricted_container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


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
        from .cache import server_volumes

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
    volumes += [dict(v) for v in spec.pod.volumes]
    mounts += [dict(m) for m in spec.pod.volume_mounts]
    return volumes, mounts


def desired_replicas(im: InferenceModel) -> int:
    """Replicas the operator sets on the Deployment (meaningless while an autoscaler owns the count)."""
    return 0 if im.spec.suspend else im.spec.scaling.replicas


def render_deployment(im: InferenceModel, defaults: ClusterDefaults | None = None) -> Manifest:
    from .routing import server_routing_ports

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
    resources = _resources(im)
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
    if spec.pod.service_account_name is not None:
        pod_spec["serviceAccountName"] = spec.pod.service_account_name
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
        "metadata": _metadata(im),
        "spec": deployment_spec,
    }


def render_service(im: InferenceModel) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(im),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector_labels(im),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_servicemonitor(im: InferenceModel) -> Manifest:
    sm = im.spec.monitoring.service_monitor
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(im, extra_labels=sm.labels),
        "spec": {
            "selector": {"matchLabels": selector_labels(im)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": sm.interval}],
        },
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a target; fractions go to milli-units ("0.8" -> "800m")."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def _scale_target_ref(im: InferenceModel) -> dict[str, str]:
    from .lws import scale_target_ref

    return scale_target_ref(im)


def render_hpa(im: InferenceModel) -> Manifest:
    scaling = im.spec.scaling
    assert scaling.max_replicas is not None  # guaranteed by the spec validator for autoscaled models
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(im),
        "spec": {
            "scaleTargetRef": _scale_target_ref(im),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": pods_metric_name(scaling.metric)},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": _quantity(scaling.effective_target),
                        },
                    },
                }
            ],
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds},
            },
        },
    }


def _promql_string(value: str) -> str:
    """A PromQL double-quoted string literal (Go escaping), so a served name with quotes stays data."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def prometheus_query(im: InferenceModel) -> str:
    """Sum over the model's own pods; KEDA divides by the replica count for an AverageValue trigger.

    Scoped by the `service` label the Prometheus Operator puts on every series scraped through a
    ServiceMonitor (the model's Service), not only by the served name: two InferenceModels serving
    the same name in one namespace must not read each other's load.
    """
    metric = METRIC_NAMES[im.spec.scaling.metric]
    matchers = ",".join(
        [
            f"namespace={_promql_string(im.namespace)}",
            f"service={_promql_string(im.child_name)}",
            f"model_name={_promql_string(im.spec.served_name)}",
        ]
    )
    return f"sum({metric}{{{matchers}}})"


def render_scaledobject(im: InferenceModel) -> Manifest:
    scaling = im.spec.scaling
    assert scaling.max_replicas is not None and scaling.prometheus_address is not None
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(im),
        "spec": {
            "scaleTargetRef": _scale_target_ref(im),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "cooldownPeriod": scaling.scale_down_delay_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds}
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": scaling.prometheus_address,
                        "query": prometheus_query(im),
                        "threshold": str(scaling.effective_target),
                    },
                },
                *_activation_triggers(im),
            ],
        },
    }


def _activation_triggers(im: InferenceModel) -> list[dict[str, Any]]:
    from .render_activator import activation_trigger, wants_activator

    return [activation_trigger(im)] if wants_activator(im) else []


def render_pdb(im: InferenceModel) -> Manifest:
    """minAvailable from the spec while at least two replicas always run (admission keeps it below
    that floor); otherwise (an autoscaler that may go down to one or zero) maxUnavailable 1, which
    never forbids every eviction however many replicas exist."""
    budget: dict[str, Any]
    # A multi-node replica is a group of pods that goes down as a unit (lws.py): one pod unavailable
    # at a time keeps at most one group down, which any admitted minAvailable allows.
    if im.spec.scaling.floor > 1 and im.spec.parallelism.nodes == 1:
        budget = {"minAvailable": im.spec.disruption.min_available}
    else:
        budget = {"maxUnavailable": 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(im),
        "spec": {**budget, "selector": {"matchLabels": selector_labels(im)}},
    }


def wants_pdb(im: InferenceModel) -> bool:
    """A PDB whenever more than one replica can exist (a fixed count above one, or an autoscaler
    allowed above one); with a single fixed replica it could only block node drains."""
    if im.spec.suspend:
        return False
    scaling = im.spec.scaling
    if im.spec.autoscaled:
        return (scaling.max_replicas or 0) > 1
    return scaling.replicas > 1


@dataclass(frozen=True)
class Capabilities:
    """Optional APIs found on the cluster, and the installation's defaults for the pods."""

    service_monitor: bool = True
    keda: bool = True
    defaults: ClusterDefaults = field(default_factory=ClusterDefaults)
    leader_worker_set: bool = True


@dataclass(frozen=True)
class ChildRef:
    """One child by kind and name (in the model's namespace)."""

    kind: str
    name: str


@dataclass(frozen=True)
class RenderPlan:
    """Every child the operator wants, plus the optional children it wants absent."""

    objects: list[Manifest]
    # Optional children the spec does not want: deleted if they exist and this model owns them.
    absent: list[ChildRef]
    monitoring_skipped_reason: str | None  # why no ServiceMonitor is rendered, if none is


OPTIONAL_KINDS = ("ServiceMonitor", "HorizontalPodAutoscaler", "ScaledObject", "PodDisruptionBudget")


# Children of the shared cache (cache.py): applied before the rest, and the Job only when missing.
CACHE_KINDS = ("PersistentVolumeClaim", "Job")
# Children that only exist once a shared cache is filled.
WAIT_FOR_CACHE_KINDS = ("Deployment", "LeaderWorkerSet", "HorizontalPodAutoscaler", "ScaledObject")


def render_all(im: InferenceModel, caps: Capabilities | None = None, cache_ready: bool = True) -> RenderPlan:
    """Every child. With cache.mode Shared the claim (unless adopted) and the loader Job come first;
    `cache_ready` False (the Job has not succeeded) leaves out the Deployment and its autoscaler, so
    no replica starts before the cache is filled (a Deployment that exists is left as it is)."""
    caps = caps or Capabilities()
    from .cache import adopts_claim, render_claim, render_job
    from .lws import LWS_KIND, lws_name, multi_node, render_leaderworkerset
    from .render_activator import ACTIVATOR_KINDS, activator_name, render_activator
    from .routing import ROUTER_KINDS, render_router, router_name

    # The router's objects come first: callers index the plan by kind, and the model's own objects
    # (later, same kinds) must win there.
    router = render_router(
        im,
        service_monitor=caps.service_monitor and im.spec.monitoring.service_monitor.enabled,
        defaults=caps.defaults,
    )
    # Order matters for a partial failure: the Service and PDB exist before pods can serve or be evicted.
    activator = render_activator(
        im,
        service_monitor=caps.service_monitor and im.spec.monitoring.service_monitor.enabled,
        defaults=caps.defaults,
    )
    objects = [*activator, *router, render_service(im)]
    # NetworkPolicies before any pod they fence (netpol.py)
    from .netpol import network_policies

    policies, unwanted_policies = network_policies(im, caps.defaults)
    objects = policies + objects
    if im.spec.cache.shared:
        cache_objects = [render_job(im, caps.defaults)]
        if not adopts_claim(im):
            cache_objects.insert(0, render_claim(im))
        objects = cache_objects + objects
    if wants_pdb(im):
        objects.append(render_pdb(im))
    if im.spec.adapters:  # before the Deployment: its pods read their adapter list from it
        objects.append(render_adapters_configmap(im, _metadata(im)))
    objects.append(
        render_leaderworkerset(im, caps.defaults) if multi_node(im) else render_deployment(im, caps.defaults)
    )
    skipped: str | None = None
    if not im.spec.monitoring.service_monitor.enabled:
        skipped = "Disabled"
    elif not caps.service_monitor:
        skipped = "CRDNotInstalled"
    else:
        objects.append(render_servicemonitor(im))
    if im.spec.autoscaled and im.spec.scaling.autoscaler == "HPA":
        objects.append(render_hpa(im))
    elif im.spec.autoscaled and im.spec.scaling.autoscaler == "KEDA":
        objects.append(render_scaledobject(im))
    # Every optional child that may exist, the router's in reverse apply order (pods go before the
    # Service and RBAC they use); whichever is not rendered now must not exist.
    optional = [ChildRef(kind, im.child_name) for kind in OPTIONAL_KINDS]
    optional.append(ChildRef("ConfigMap", configmap_name(im)))
    # The workload kind the spec does not use (a switch between one node and several); no
    # LeaderWorkerSet can exist where the cluster does not serve the kind.
    optional.append(ChildRef("Deployment", im.child_name))
    if caps.leader_worker_set:
        optional.append(ChildRef(LWS_KIND, lws_name(im)))
    optional += [ChildRef(kind, router_name(im)) for kind in reversed(ROUTER_KINDS)]
    optional += unwanted_policies
    optional += [ChildRef(kind, activator_name(im)) for kind in reversed(ACTIVATOR_KINDS)]
    if not cache_ready:
        objects = [
            o
            for o in objects
            if not (
                o["kind"] in WAIT_FOR_CACHE_KINDS and o["metadata"]["name"] in (im.child_name, lws_name(im))
            )
        ]
    present = {ChildRef(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    # While the cache fills, the autoscaler of a Deployment that serves an older revision stays.
    absent = [
        ref
        for ref in optional
        if ref not in present and (cache_ready or ref.kind not in WAIT_FOR_CACHE_KINDS)
    ]
    return RenderPlan(objects=objects, absent=absent, monitoring_skipped_reason=skipped)


# Keys whose values are quantities: the API server rewrites them canonically ("0.5" -> "500m").
_QUANTITY_KEYS = frozenset({"requests", "limits", "sizeLimit"})


def is_subset(desired: Any, live: Any, quantities: bool = False) -> bool:
    """True if every field of `desired` has the same value in `live` (lists compared item by item).

    Used to detect hand edits of a child: the API server adds defaults, which are ignored here, and
    stores quantities canonically, which are compared by value.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and is_subset(v, live[k], quantities or k in _QUANTITY_KEYS) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v, quantities) for d, v in zip(desired, live, strict=True))
        )
    if quantities and desired != live and same_quantity(desired, live):
        return True
    if isinstance(desired, (int, float)) and isinstance(live, str):
        return str(desired) == live
    return bool(desired == live)
