"""The admission table: InferenceModels whose children the API server or the kubelet would refuse or
never make ready, each with the verdict and the message a user gets. Accepted rows must render
children the API server accepts (names derived, defaults filled); refused rows must be refused
with the same message by the CRD (schema + CEL) and by `render` (the pydantic models)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF = {"uri": "hf://org/model"}
S3 = {"uri": "s3://models/llama/v1", "credentialsSecretRef": {"name": "s3-creds"}}
SHARED = {"mode": "Shared", "size": "20Gi"}
S3_URI_MESSAGE = "model.uri s3:// must look like s3://bucket/prefix"
OCI_URI_MESSAGE = "model.uri oci:// must look like oci://registry/repo:tag"


@dataclass(frozen=True)
class Row:
    id: str
    spec: dict[str, Any]
    refusal: str | None  # None: accepted
    name: str = "m"
    extra: dict[str, Any] = field(default_factory=dict)


def _s(**parts: Any) -> dict[str, Any]:
    return {"model": HF, **parts}


CANARY_SHARED = "canary cannot be combined with cache.mode Shared or an s3:// canary.model"


def _canary(
    weight: int | None,
    model: dict[str, Any] | None = None,
    replicas: int | None = None,
    routing_enabled: bool = False,
    **parts: Any,
) -> dict[str, Any]:
    """A model with spec.canary behind a Gateway (what a canary needs)."""
    canary: dict[str, Any] = {"model": model or {"uri": "hf://org/model-v2"}}
    if weight is not None:
        canary["weight"] = weight
    if replicas is not None:
        canary["replicas"] = replicas
    gateway = {"enabled": True, "gatewayRef": {"name": "inference-gw", "namespace": "gw"}}
    return _s(canary=canary, routing={"enabled": routing_enabled, "gateway": gateway}, **parts)


PSS_VOLUMES = "volume types of the restricted Pod Security Standard"
LOADER_ENV = "pod.env must not set a variable that changes what the loader or interpreter runs"
MOUNT_PATH = "pod.volumeMounts paths must be absolute, without '..', under /data or /mnt"
ENV_FROM = "pod.envFrom entries need a prefix that no refused variable name starts with"
TRUST_REMOTE_CODE = "engine.extraArgs must not contain --trust-remote-code"
ANNOTATIONS = "pod.annotations must not set the legacy seccomp annotations"
UNKNOWN_FLAG = "engine.extraArgs may contain only flags of the server that the operator does not manage"

LONG_NAME = "a-very-long-inference-model-name-for-a-fine-tuned-llama-3.1-8b-instruct"  # 72 chars

ADMISSION: list[Row] = [
    # names: any name the API server accepts for the InferenceModel deploys (children derive theirs)
    Row("name-with-dot", _s(), None, name="llama-3.1-8b"),
    Row("name-leading-digit", _s(), None, name="7b-chat"),
    Row("name-64-plus", _s(), None, name=LONG_NAME),
    # rollout strategy
    Row("surge-0-alone", _s(rollout={"maxSurge": 0}), None),
    Row("surge-0-percent-alone", _s(rollout={"maxSurge": "0%"}), None),
    Row(
        "surge-and-unavailable-0",
        _s(rollout={"maxSurge": 0, "maxUnavailable": 0}),
        "cannot both be 0",
    ),
    Row("surge-negative", _s(rollout={"maxSurge": -1}), "rollout.maxSurge must be a non-negative number"),
    Row(
        "surge-not-percent", _s(rollout={"maxSurge": "two"}), "rollout.maxSurge must be a non-negative number"
    ),
    Row(
        "unavailable-negative",
        _s(rollout={"maxUnavailable": -1}),
        "rollout.maxUnavailable must be a non-negative number",
    ),
    Row("unavailable-over-100", _s(rollout={"maxUnavailable": "150%"}), "must not exceed 100%"),
    # cache.mode Shared (issue 21 item 6): a claim per model filled by a loader Job
    Row(
        "cache-shared-created", _s(cache={"mode": "Shared", "size": "20Gi", "storageClassName": "nfs"}), None
    ),
    Row("cache-shared-adopted", _s(cache={"mode": "Shared", "claimName": "models-rwx"}), None),
    Row(
        "cache-shared-rwx-autoscaled",
        _s(
            cache={"mode": "Shared", "size": "20Gi", "accessModes": ["ReadWriteMany"]},
            scaling={"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 8},
        ),
        None,
    ),
    Row(
        "cache-shared-rwo-one-pod",
        _s(
            cache={"mode": "Shared", "size": "20Gi", "accessModes": ["ReadWriteOnce"]},
            rollout={"maxSurge": 0},
        ),
        None,
    ),
    Row(
        "cache-shared-rwo-two-replicas",
        _s(
            cache={"mode": "Shared", "size": "20Gi", "accessModes": ["ReadWriteOnce"]},
            scaling={"replicas": 2},
            rollout={"maxSurge": 0},
        ),
        "cache.accessModes without ReadWriteMany serve one pod",
    ),
    Row(
        "cache-shared-rwo-surge",  # one replica, but a rollout runs a second pod beside it
        _s(cache={"mode": "Shared", "size": "20Gi", "accessModes": ["ReadWriteOnce"]}),
        "cache.accessModes without ReadWriteMany serve one pod",
    ),
    Row(
        "cache-shared-rwop-autoscaled",
        _s(
            cache={"mode": "Shared", "size": "20Gi", "accessModes": ["ReadWriteOncePod"]},
            scaling={"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 2},
            rollout={"maxSurge": 0},
        ),
        "cache.accessModes without ReadWriteMany serve one pod",
    ),
    Row("cache-shared-no-size", _s(cache={"mode": "Shared"}), "cache.mode Shared needs cache.size"),
    Row(
        "cache-shared-zero-size", _s(cache={"mode": "Shared", "size": "0Gi"}), "cache.size must be above zero"
    ),
    Row(
        "cache-shared-adopt-with-size",
        _s(cache={"mode": "Shared", "claimName": "x", "size": "1Gi"}),
        "leave them unset when adopting cache.claimName",
    ),
    Row(
        "cache-perpod-with-size",
        _s(cache={"size": "1Gi"}),
        "describe the claim of cache.mode Shared",
    ),
    Row(
        "cache-shared-bad-class",
        _s(cache={"mode": "Shared", "size": "1Gi", "storageClassName": "Fast_SSD"}),
        "cache.storageClassName must be a DNS-1123 subdomain",
    ),
    Row(
        "cache-shared-pvc-model",
        {"model": {"uri": "pvc://weights/llama"}, "cache": {"mode": "Shared", "size": "1Gi"}},
        "cache.mode Shared downloads hf:// and s3:// models",
    ),
    # issue 48: models from S3 (the shared cache's loader downloads them) and OCI images (image volumes)
    Row("s3-model", {"model": S3, "cache": SHARED}, None),
    Row("s3-model-root-of-bucket", {"model": {"uri": "s3://models.example"}, "cache": SHARED}, None),
    Row("s3-needs-shared-cache", {"model": S3}, "an s3:// model needs cache.mode Shared"),
    Row("s3-bad-bucket", {"model": {"uri": "s3://Models_1/llama"}, "cache": SHARED}, S3_URI_MESSAGE),
    Row("s3-dotdot", {"model": {"uri": "s3://models/a/../b"}, "cache": SHARED}, S3_URI_MESSAGE),
    Row("s3-empty-segment", {"model": {"uri": "s3://models//b"}, "cache": SHARED}, S3_URI_MESSAGE),
    Row(
        "s3-secret-key-set",
        {"model": {**S3, "credentialsSecretRef": {"name": "s3-creds", "key": "password"}}, "cache": SHARED},
        "model.credentialsSecretRef.key is for hf:// tokens",
    ),
    Row(
        "s3-revision",
        {"model": {**S3, "revision": "v2"}, "cache": SHARED},
        "model.revision is only meaningful for hf:// models",
    ),
    Row("gs-refused", {"model": {"uri": "gs://bucket/llama"}}, "gs:// is not supported"),
    Row("unknown-scheme", {"model": {"uri": "http://example.com/llama"}}, "model.uri must start with hf://"),
    Row("oci-model", {"model": {"uri": "oci://registry.example.com/models/llama:v1"}}, None),
    Row("oci-model-digest", {"model": {"uri": f"oci://ghcr.io/org/llama@sha256:{'a' * 64}"}}, None),
    Row("oci-bad-reference", {"model": {"uri": "oci://registry.example.com/Models/LLAMA"}}, OCI_URI_MESSAGE),
    Row("oci-no-reference", {"model": {"uri": "oci://"}}, OCI_URI_MESSAGE),
    Row(
        "oci-with-shared-cache",
        {"model": {"uri": "oci://registry.example.com/llama:v1"}, "cache": SHARED},
        "cache.mode Shared downloads hf:// and s3:// models",
    ),
    Row(
        "cache-shared-bad-mode",
        _s(cache={"mode": "Shared", "size": "1Gi", "accessModes": ["ReadOnlyMany"]}),
        'spec.cache.accessModes[0]: Unsupported value: "ReadOnlyMany": supported values: "ReadWriteMany", '
        '"ReadWriteOnce", "ReadWriteOncePod"',
    ),
    # image and flags
    Row("image-ok", _s(engine={"image": "registry.local:5000/ml/server:1.2@sha256:" + "a" * 64}), None),
    Row(
        "image-space", _s(engine={"image": "ghcr.io/kubeinfer/server: 0.1"}), "engine.image must be an image"
    ),
    Row("image-upper", _s(engine={"image": "ghcr.io/KubeInfer/Server"}), "engine.image must be an image"),
    Row(
        "managed-flag", _s(engine={"extraArgs": ["--port=9000"]}), "must not set a flag the operator manages"
    ),
    Row(
        "managed-flag-split",
        _s(engine={"extraArgs": ["--model", "x"]}),
        "must not set a flag the operator manages",
    ),
    Row(
        "managed-flag-lws",
        _s(engine={"extraArgs": ["--nnodes=2"]}),
        "must not set a flag the operator manages",
    ),
    # issue 25 item 3: a flag the server's parser refuses (vLLM-only, a typo, an abbreviation) is
    # refused at admission instead of crash-looping the pod; values are separate arguments
    Row("unknown-flag", _s(engine={"extraArgs": ["--seed=1"]}), UNKNOWN_FLAG),
    Row("unknown-flag-split", _s(engine={"extraArgs": ["--gpu-memory-utilization", "0.9"]}), UNKNOWN_FLAG),
    Row("flag-abbreviation", _s(engine={"extraArgs": ["--mod=x"]}), UNKNOWN_FLAG),
    Row("server-flag", _s(engine={"extraArgs": ["--max-num-batched-tokens=4096"]}), None),
    Row("server-flag-value", _s(engine={"extraArgs": ["--block-size", "32", "--no-ui"]}), None),
    Row(
        "managed-flag-negated",
        _s(engine={"extraArgs": ["--no-enable-prefix-caching"]}),
        "must not set a flag the operator manages",
    ),
    Row(
        "managed-admin-key",
        _s(engine={"extraArgs": ["--admin-api-key=k"]}),
        "must not set a flag the operator manages",
    ),
    # resources
    Row("cpu-half", _s(resources={"cpu": "0.5", "memory": "1.5Gi"}), None),
    Row("cpu-negative", _s(resources={"cpu": "-1"}), "spec.resources.cpu in body should match '^(\\+)?"),
    Row("cpu-negative-int", _s(resources={"cpu": -2}), "resources.cpu must not be negative"),
    Row("memory-negative-int", _s(resources={"memory": -2}), "resources.memory must not be negative"),
    Row("cache-negative", _s(cache={"sizeLimit": -1}), "cache.sizeLimit must not be negative"),
    Row(
        "gpu-product-long",
        _s(resources={"gpu": {"product": "N" * 64}}),
        "spec.resources.gpu.product: Too long: may not be more than 63 bytes",
    ),
    Row(
        "gpu-product-space",
        _s(resources={"gpu": {"product": "NVIDIA H100"}}),
        "gpu.product must be a node label",
    ),
    Row("gpu-resource-bare", _s(resources={"gpu": {"resourceName": "gpu"}}), "extended resource name"),
    Row("gpu-resource-amd", _s(resources={"gpu": {"resourceName": "amd.com/gpu"}}), None),
    # references to other objects
    Row("claim-upper", _s(cache={"claimName": "Models"}), "cache.claimName must be a DNS-1123 subdomain"),
    Row(
        "secret-name-bad",
        {"model": {**HF, "credentialsSecretRef": {"name": "HF_Token"}}},
        "a Secret name must be a DNS-1123 subdomain",
    ),
    Row(
        "secret-key-bad",
        {"model": {**HF, "credentialsSecretRef": {"name": "hf", "key": "a/b"}}},
        "a Secret key may only hold",
    ),
    Row("secret-key-defaulted", {"model": {**HF, "credentialsSecretRef": {"name": "hf-token"}}}, None),
    Row("api-key-defaulted", _s(engine={"apiKeySecretRef": {"name": "api"}}), None),
    # scheduling
    Row(
        "node-selector-ok",
        _s(scheduling={"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}}),
        None,
    ),
    Row(
        "node-selector-bad-value",
        _s(scheduling={"nodeSelector": {"pool": "gpu pool"}}),
        "scheduling.nodeSelector must map label keys",
    ),
    Row(
        "node-selector-bad-key",
        _s(scheduling={"nodeSelector": {"-pool": "gpu"}}),
        "scheduling.nodeSelector must map label keys",
    ),
    Row(
        "priority-class-bad",
        _s(scheduling={"priorityClassName": "High_Priority"}),
        "priorityClassName must be",
    ),
    Row("runtime-class-bad", _s(scheduling={"runtimeClassName": "NVIDIA"}), "runtimeClassName must be"),
    Row(
        "sm-labels-bad",
        _s(monitoring={"serviceMonitor": {"labels": {"release": "kube prometheus"}}}),
        "serviceMonitor.labels must map",
    ),
    # autoscaling and disruption
    Row(
        "keda-address-bad",
        _s(scaling={"autoscaler": "KEDA", "maxReplicas": 3, "prometheusAddress": "prometheus:9090"}),
        "prometheusAddress must be an http",
    ),
    Row(
        "pdb-forbids-all",
        _s(scaling={"replicas": 2}, disruption={"minAvailable": 2}),
        "must leave a pod evictable",
    ),
    Row(
        "pdb-forbids-all-percent",
        _s(scaling={"replicas": 3}, disruption={"minAvailable": "100%"}),
        "must leave a pod evictable",
    ),
    Row(
        "pdb-forbids-all-hpa",
        _s(scaling={"autoscaler": "HPA", "minReplicas": 2, "maxReplicas": 4}, disruption={"minAvailable": 3}),
        "must leave a pod evictable",
    ),
    Row("pdb-ok", _s(scaling={"replicas": 3}, disruption={"minAvailable": 2}), None),
    Row("pdb-single-replica", _s(disruption={"minAvailable": 1}), None),
    Row(
        "pdb-negative", _s(disruption={"minAvailable": -1}), "disruption.minAvailable must be a non-negative"
    ),
    Row(
        "pdb-over-100",
        _s(disruption={"minAvailable": "101%"}),
        "disruption.minAvailable must not exceed 100%",
    ),
    # pod customization
    Row(
        "pod-all-fields",
        _s(
            pod={
                "labels": {"team": "search"},
                "annotations": {"prometheus.io/scrape": "false"},
                "serviceAccountName": "llm-reader",
                "imagePullSecrets": [{"name": "regcred"}],
                "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                "envFrom": [{"configMapRef": {"name": "tuning"}, "prefix": "TUNING_"}],
                "volumes": [{"name": "extra", "configMap": {"name": "chat-templates"}}],
                "volumeMounts": [{"name": "extra", "mountPath": "/data/templates", "readOnly": True}],
                "shmSize": "4Gi",
            },
            scheduling={
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway",
                    }
                ]
            },
        ),
        None,
    ),
    Row("pod-label-bad", _s(pod={"labels": {"team": "a b"}}), "pod.labels must map"),
    Row(
        "pod-label-ours",
        _s(pod={"labels": {"app.kubernetes.io/instance": "x"}}),
        "must not set the app.kubernetes.io",
    ),
    Row("pod-sa-bad", _s(pod={"serviceAccountName": "My_SA"}), "pod.serviceAccountName must be"),
    Row(
        "pod-pull-secret-bad",
        _s(pod={"imagePullSecrets": [{"name": "Reg_Cred"}]}),
        "pod.imagePullSecrets entries",
    ),
    Row("pod-env-ours", _s(pod={"env": [{"name": "HF_TOKEN", "value": "x"}]}), "pod.env must not set"),
    Row(
        "pod-env-lws",
        _s(pod={"env": [{"name": "LWS_WORKER_INDEX", "value": "0"}]}),
        "pod.env must not set",
    ),
    Row(
        "pod-volume-ours",
        _s(pod={"volumes": [{"name": "cache", "emptyDir": {}}]}),
        "pod.volumes must not reuse",
    ),
    Row(
        "pod-mount-ours",
        _s(
            pod={
                "volumes": [{"name": "x", "emptyDir": {}}],
                "volumeMounts": [{"name": "x", "mountPath": "/tmp"}],
            }
        ),
        "pod.volumeMounts must not reuse",
    ),
    Row(
        "pod-mount-unknown-volume",
        _s(pod={"volumeMounts": [{"name": "nope", "mountPath": "/data"}]}),
        "must name a volume in pod.volumes",
    ),
    Row("pod-shm-negative", _s(pod={"shmSize": -1}), "pod.shmSize must not be negative"),
    # multi-GPU and multi-node (tensor parallelism over all ranks of a replica)
    Row("tp-4-gpus", _s(engine={"tensorParallelSize": 4}, resources={"gpu": {"count": 4}}), None),
    Row(
        "nodes-2-ok",
        _s(
            engine={"tensorParallelSize": 8},
            resources={"gpu": {"count": 4}},
            parallelism={"nodes": 2},
            scaling={"replicas": 2},
        ),
        None,
        name=LONG_NAME,
    ),
    Row(
        "nodes-tp-per-pod",
        _s(engine={"tensorParallelSize": 4}, resources={"gpu": {"count": 4}}, parallelism={"nodes": 2}),
        "engine.tensorParallelSize must equal resources.gpu.count x parallelism.nodes",
    ),
    Row(
        "nodes-cpu",
        _s(engine={"tensorParallelSize": 2}, resources={"gpu": {"count": 0}}, parallelism={"nodes": 2}),
        "parallelism.nodes > 1 needs resources.gpu.count >= 1",
    ),
    Row(
        "nodes-hpa",
        _s(
            engine={"tensorParallelSize": 2},
            resources={"gpu": {"count": 1}},
            parallelism={"nodes": 2},
            scaling={"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 3},
        ),
        None,  # the HPA scales LWS groups through the LWS scale subresource
    ),
    Row(
        "nodes-keda-to-zero",
        _s(
            engine={"tensorParallelSize": 4},
            resources={"gpu": {"count": 2}},
            parallelism={"nodes": 2},
            scaling={
                "autoscaler": "KEDA",
                "minReplicas": 0,
                "replicas": 0,
                "maxReplicas": 2,
                "prometheusAddress": "http://prometheus:9090",
            },
        ),
        None,
    ),
    # bounds (issue 29 F2): every string, list and map a user sets is bounded, so the API server's
    # CEL cost estimate of each rule stays within its budget
    Row("labels-at-64", _s(pod={"labels": {f"l{i}": "v" for i in range(64)}}), None),
    Row(
        "labels-over-64",
        _s(pod={"labels": {f"l{i}": "v" for i in range(65)}}),
        "spec.pod.labels: Too many: 65: must have at most 64 items",
    ),
    Row(
        "node-selector-over-64",
        _s(scheduling={"nodeSelector": {f"l{i}": "v" for i in range(65)}}),
        "spec.scheduling.nodeSelector: Too many: 65: must have at most 64 items",
    ),
    Row(
        "service-monitor-labels-value-64",
        _s(monitoring={"serviceMonitor": {"labels": {"release": "x" * 64}}}),
        "Too long: may not be more than 63 bytes",
    ),
    Row(
        "annotations-over-64",
        _s(pod={"annotations": {f"a{i}": "v" for i in range(65)}}),
        "spec.pod.annotations: Too many: 65: must have at most 64 items",
    ),
    Row(
        "surge-too-long",
        _s(rollout={"maxSurge": "1" * 64 + "%"}),
        "spec.rollout.maxSurge: Too long: may not be more than 64 bytes",
    ),
    Row(
        "cpu-too-long",
        _s(resources={"cpu": "1" * 65}),
        "spec.resources.cpu: Too long: may not be more than 64 bytes",
    ),
    Row(
        "pull-secrets-over-16",
        _s(pod={"imagePullSecrets": [{"name": f"s{i}"} for i in range(17)]}),
        "spec.pod.imagePullSecrets: Too many: 17: must have at most 16 items",
    ),
    Row(
        "env-over-128",
        _s(pod={"env": [{"name": f"V{i}", "value": "x"} for i in range(129)]}),
        "spec.pod.env: Too many: 129: must have at most 128 items",
    ),
    Row(
        "env-name-too-long",
        _s(pod={"env": [{"name": "V" * 257, "value": "x"}]}),
        "spec.pod.env[0].name: Too long: may not be more than 256 bytes",
    ),
    Row(
        "volumes-over-64",
        _s(pod={"volumes": [{"name": f"v{i}", "emptyDir": {}} for i in range(65)]}),
        "spec.pod.volumes: Too many: 65: must have at most 64 items",
    ),
    Row(
        "mount-path-too-long",
        _s(
            pod={
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volumeMounts": [{"name": "data", "mountPath": "/" + "d" * 1024}],
            }
        ),
        "spec.pod.volumeMounts[0].mountPath: Too long: may not be more than 1024 bytes",
    ),
    # issue 25 item 3: a model author gets no more than the restricted Pod Security Standard, no
    # variable that changes what the loader or interpreter runs, no flag the server refuses
    Row("pod-volume-hostpath", _s(pod={"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}), PSS_VOLUMES),
    Row(
        "pod-volume-nfs",
        _s(pod={"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}),
        PSS_VOLUMES,
    ),
    Row("pod-volume-image", _s(pod={"volumes": [{"name": "i", "image": {"reference": "x"}}]}), PSS_VOLUMES),
    Row(
        "pod-volume-restricted-types",
        _s(
            pod={
                "volumes": [
                    {"name": "a", "emptyDir": {}},
                    {"name": "b", "persistentVolumeClaim": {"claimName": "c"}},
                    {"name": "c", "projected": {"sources": [{"configMap": {"name": "x"}}]}},
                ]
            }
        ),
        None,
    ),
    *[
        Row(f"pod-env-{name.lower()}", _s(pod={"env": [{"name": name, "value": "/tmp/x"}]}), LOADER_ENV)
        for name in ("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")
    ],
    Row(
        "pod-env-admin-key", _s(pod={"env": [{"name": "KUBEINFER_ADMIN_API_KEY", "value": "x"}]}), LOADER_ENV
    ),
    Row("pod-env-unbuffered", _s(pod={"env": [{"name": "PYTHONUNBUFFERED", "value": "1"}]}), None),
    # issue 45 item 1: variables that redirect or weaken the server's network and TLS (a hub token sent
    # to another host), the C library's, the interpreter's and the server's own flags' variables
    *[
        Row(
            f"pod-env-net-{name.lower()}",
            _s(pod={"env": [{"name": name, "value": "https://a.example"}]}),
            LOADER_ENV,
        )
        for name in (
            "HF_ENDPOINT",
            "HF_HUB_DISABLE_TELEMETRY",
            "HTTPS_PROXY",
            "Https_Proxy",
            "all_proxy",
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "GLIBC_TUNABLES",
            "LOCPATH",
            "PYTHONPYCACHEPREFIX",
            "PYTHONSAFEPATH",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            "LORA_ALLOWED_PATHS",
            "MODEL_ID",
            "KUBEINFER_CHAT_TEMPLATE",
        )
    ],
    # issue 45 item 2: mounts over code, kernels, certificates or the model cache (a trailing slash or
    # `..` passed the exact-string check)
    *[
        Row(
            f"pod-mount-{i}",
            _s(
                pod={
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "volumeMounts": [{"name": "x", "mountPath": p}],
                }
            ),
            MOUNT_PATH,
        )
        for i, p in enumerate(
            (
                "/usr/lib/python3.11/sitecustomize.py",
                "/var/cache/kubeinfer/kernels",
                "/models/",
                "/etc/ssl/certs",
                "/data/../usr/lib",
                "data/x",
                "/datasets",
            )
        )
    ],
    *[
        Row(
            f"pod-mount-ok-{i}",
            _s(
                pod={
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "volumeMounts": [{"name": "x", "mountPath": p}],
                }
            ),
            None,
        )
        for i, p in enumerate(("/data", "/data/templates/", "/mnt/scratch"))
    ],
    Row(
        "pod-envfrom-prefix-too-long",
        _s(pod={"envFrom": [{"configMapRef": {"name": "c"}, "prefix": "A" * 65}]}),
        "spec.pod.envFrom[0].prefix: Too long: may not be more than 64 bytes",
    ),
    Row("pod-env-plain", _s(pod={"env": [{"name": "APP_MODE", "value": "x"}]}), None),
    *[
        Row(
            f"pod-envfrom-net-prefix-{prefix.lower().rstrip('_')}",
            _s(pod={"envFrom": [{"configMapRef": {"name": "c"}, "prefix": prefix}]}),
            ENV_FROM,
        )
        for prefix in ("HTTPS", "Http", "no_", "HF_", "HF_HUB_", "SSL_CERT_", "VLLM_", "LORA_", "MODEL_")
    ],
    Row("pod-envfrom-no-prefix", _s(pod={"envFrom": [{"configMapRef": {"name": "c"}}]}), ENV_FROM),
    Row(
        "pod-envfrom-ld-prefix",
        _s(pod={"envFrom": [{"configMapRef": {"name": "c"}, "prefix": "LD_"}]}),
        ENV_FROM,
    ),
    Row(
        "pod-envfrom-p-prefix",
        _s(pod={"envFrom": [{"configMapRef": {"name": "c"}, "prefix": "PY"}]}),
        ENV_FROM,
    ),
    Row(
        "pod-envfrom-app-prefix",
        _s(pod={"envFrom": [{"configMapRef": {"name": "c"}, "prefix": "APP_"}]}),
        None,
    ),
    Row(
        "pod-apparmor-unconfined",
        _s(pod={"annotations": {"container.apparmor.security.beta.kubernetes.io/server": "unconfined"}}),
        "AppArmor profiles to runtime/default or localhost",
    ),
    Row(
        "pod-apparmor-runtime-default",
        _s(pod={"annotations": {"container.apparmor.security.beta.kubernetes.io/server": "runtime/default"}}),
        None,
    ),
    # annotations the API server refuses on the pod template, or that weaken the pod (issue 48)
    Row(
        "pod-legacy-seccomp-unconfined",
        _s(pod={"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}}),
        ANNOTATIONS,
    ),
    Row(
        "pod-legacy-container-seccomp",
        _s(pod={"annotations": {"container.seccomp.security.alpha.kubernetes.io/server": "runtime/default"}}),
        ANNOTATIONS,
    ),
    Row(
        "pod-apparmor-other-container",
        _s(
            pod={"annotations": {"container.apparmor.security.beta.kubernetes.io/sidecar": "runtime/default"}}
        ),
        ANNOTATIONS,
    ),
    Row("pod-kubelet-mirror", _s(pod={"annotations": {"kubernetes.io/config.mirror": "x"}}), ANNOTATIONS),
    Row("pod-plain-annotation", _s(pod={"annotations": {"example.com/team": "search"}}), None),
    # spec.routing.gateway (issue 48 item 1)
    Row(
        "gateway-on",
        _s(routing={"gateway": {"enabled": True, "gatewayRef": {"name": "inference-gw", "namespace": "gw"}}}),
        None,
    ),
    Row(
        "gateway-bad-image",
        _s(routing={"gateway": {"enabled": True, "endpointPicker": {"image": "UPPER case"}}}),
        "routing.gateway.endpointPicker.image must be an image reference",
    ),
    Row(
        "gateway-ref-bad-namespace",
        _s(routing={"gateway": {"enabled": True, "gatewayRef": {"name": "gw", "namespace": "a.b"}}}),
        "in body should match",
    ),
    Row("gateway-priority", _s(routing={"gateway": {"enabled": True, "priority": -10}}), None),
    # the bound in the API server's words ("greater than the maximum of 1000") and pydantic's differ
    Row("gateway-priority-too-high", _s(routing={"gateway": {"enabled": True, "priority": 1001}}), "1000"),
    Row("gateway-priority-too-low", _s(routing={"gateway": {"enabled": True, "priority": -1001}}), "-1000"),
    # spec.canary (issue 48 item 4): weighted by the gateway's HTTPRoute, so it needs a gatewayRef
    Row("canary-weight-10", _canary(10), None),
    Row("canary-weight-0", _canary(0), None),
    Row("canary-weight-100", _canary(100), None),
    Row("canary-replicas-0", _canary(5, replicas=0), None),
    Row("canary-weight-over-100", _canary(101), "100"),
    Row("canary-weight-negative", _canary(-1), "0"),
    Row("canary-weight-missing", _canary(None), "weight"),
    Row("canary-bad-uri", _canary(10, model={"uri": "ftp://models/x"}), "model.uri must start with hf://"),
    Row("canary-bad-hf", _canary(10, model={"uri": "hf://only-org"}), "model.uri hf:// must look like"),
    Row(
        "canary-revision-not-hf",
        _canary(10, model={"uri": "/models/v2", "revision": "main"}),
        "model.revision is only meaningful for hf:// models",
    ),
    Row(
        "canary-bad-secret-name",
        _canary(10, model={**HF, "credentialsSecretRef": {"name": "A_B"}}),
        "DNS-1123",
    ),
    Row("canary-pvc", _canary(10, model={"uri": "pvc://models/v2"}), None),
    Row("canary-oci", _canary(10, model={"uri": "oci://registry.example/models/m:v2"}), None),
    Row("canary-s3", _canary(10, model=S3), CANARY_SHARED),
    Row("canary-shared-cache", _canary(10, cache=SHARED), CANARY_SHARED),
    Row(
        "canary-without-gateway",
        {"model": HF, "canary": {"model": {"uri": "hf://org/model-v2"}, "weight": 10}},
        "canary needs routing.gateway.enabled with a gatewayRef",
    ),
    Row(
        "canary-without-gateway-ref",
        {
            "model": HF,
            "canary": {"model": {"uri": "hf://org/model-v2"}, "weight": 10},
            "routing": {"gateway": {"enabled": True}},
        },
        "canary needs routing.gateway.enabled with a gatewayRef",
    ),
    Row("canary-with-router", _canary(10, routing_enabled=True), "vllm-router has no per-worker weights"),
    Row(
        "canary-multi-node",
        _canary(
            10, parallelism={"nodes": 2}, resources={"gpu": {"count": 1}}, engine={"tensorParallelSize": 2}
        ),
        "canary cannot be combined with parallelism.nodes > 1",
    ),
    Row("canary-scale-to-zero", _canary(10, scaling={"minReplicas": 0, "replicas": 1}), "scaling to zero"),
    Row(
        "canary-other-served-name",
        _canary(10, model={**HF, "servedName": "other"}),
        "canary.model.servedName, if set, must equal model.servedName",
    ),
    # spec.network (issue 25 item 2)
    Row("network-peer-empty", _s(network={"allowedClients": [{}]}), "network.allowedClients entries need"),
    Row(
        "network-peer-namespace",
        _s(network={"allowedClients": [{"namespaceSelector": {"matchLabels": {"team": "search"}}}]}),
        None,
    ),
    Row("network-opt-out", _s(network={"networkPolicy": False}), None),
    Row("trust-remote-code", _s(engine={"extraArgs": ["--trust-remote-code"]}), TRUST_REMOTE_CODE),
    Row("trust-remote-code-eq", _s(engine={"extraArgs": ["--trust-remote-code=true"]}), TRUST_REMOTE_CODE),
]
