"""Pydantic models of the InferenceModel custom resource (spec and status).

These mirror crds/kubeinfer.dev_inferencemodels.yaml field for field (tests check the two stay in step).
The CRD's CEL rules are repeated here as model validators so that `render` without a cluster rejects
exactly what the API server would reject.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import admission
from .names import (
    DNS1123_SUBDOMAIN,
    child_name,
    derived_name,
    is_dns1123_label,
    is_dns1123_subdomain,
    is_label_value,
    is_qualified_name,
)

GROUP = "kubeinfer.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceModel"
PLURAL = "inferencemodels"

DEFAULT_SERVER_IMAGE = "ghcr.io/kubeinfer/server:0.1.0"
# The CPU build of Dockerfile.server (scripts/images/build.sh): for models with resources.gpu.count 0.
DEFAULT_SERVER_CPU_IMAGE = "ghcr.io/kubeinfer/server:0.1.0-cpu"
# Dockerfile.router: vLLM's router (PyPI vllm-router, pinned there) on a non-root base.
DEFAULT_ROUTER_IMAGE = "ghcr.io/kubeinfer/router:0.1.17"
# The Gateway API Inference Extension's endpoint picker (a chart value, KUBEINFER_DEFAULT_ENDPOINT_PICKER_IMAGE).
DEFAULT_ENDPOINT_PICKER_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
OPERATOR_IMAGE = "ghcr.io/kubeinfer/operator:0.1.0"

# The CRD bounds every string, list and map a user sets (the API server's CEL cost estimate sizes each
# rule by them, issue 29); these are the same bounds.
IntOrString = Annotated[int, Strict()] | Annotated[str, Field(max_length=64)]
LabelMap = Annotated[dict[str, Annotated[str, Field(max_length=63)]], Field(max_length=64)]

Quantization = Literal[
    "awq", "gptq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8", "int8", "int4"
]
Metric = Literal["QueueDepth", "KVCacheUsage", "RunningRequests"]
Autoscaler = Literal["HPA", "KEDA", "None"]

# The patterns also appear in the CRD's CEL rules; keep them identical.
HF_URI = re.compile(r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
PVC_URI = re.compile(r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?$")
# server/download_s3.py's S3_URI: a bucket name, then non-empty segments none of which is only dots.
S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/]*[^/.][^/]*)*/?$")
# An OCI image holding the model folder (IMAGE_REF after the scheme), mounted as an image volume.
OCI_URI = re.compile(
    "^oci://([a-zA-Z0-9][a-zA-Z0-9.-]*(:[0-9]+)?/)?[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*"
    "(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$"
)
MODEL_SCHEMES = ("hf://", "pvc://", "s3://", "oci://", "/")
URI_MESSAGE = (
    "model.uri must start with hf://, pvc://, s3://, oci:// or / (a path inside the image); gs:// is not "
    "supported (use GCS's S3-compatible XML API: s3:// with AWS_ENDPOINT_URL https://storage.googleapis.com "
    "and HMAC keys)"
)
# The keys an s3:// model's credentialsSecretRef Secret holds (the AWS SDK's variable names, as KServe's
# and KubeAI's); the endpoint and region are optional.
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_OPTIONAL_SECRET_KEYS = ("AWS_ENDPOINT_URL", "AWS_REGION")
IMAGE_PATH = re.compile(r"^/.+$")
DURATION = re.compile(r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
# A non-negative Kubernetes quantity (the API server refuses negative requests and limits).
QUANTITY = re.compile(
    r"^(\+)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# An image reference as the container runtime parses it ([host[:port]/]path[:tag][@sha256:digest]);
# anything else never starts (InvalidImageName). No backslashes: the CEL copy stays escape-free.
IMAGE_REF = re.compile(
    "^([a-zA-Z0-9][a-zA-Z0-9.-]*(:[0-9]+)?/)?[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*"
    "(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$"
)
EXTENDED_RESOURCE = re.compile(f"^{DNS1123_SUBDOMAIN}/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$")
SECRET_KEY = re.compile("^[-._a-zA-Z0-9]+$")
PERCENT = re.compile("^[0-9]+%$")
PROMETHEUS_URL = re.compile("^https?://[^/ ]+(/[^ ]*)?$")

# Flags the operator sets itself; an extraArgs entry that repeats one would silently fight the operator.
MANAGED_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--quantize",
        "--dtype",
        "--task",
        "--max-total-tokens",
        "--max-num-seqs",
        "--max-concurrent-requests",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--speculative-config",
        "--tensor-parallel-size",
        "--kv-events-config",
        "--objective-priority",  # from routing.gateway.priority (gateway.py)
        "--enable-lora",
        "--no-enable-lora",
        "--lora-modules",
        "--max-loras",
        "--max-cpu-loras",
        "--allow-runtime-lora-updating",
        "--no-allow-runtime-lora-updating",
        "--api-key",
        # credentials.py: the operator's management credential, from its Secret through the environment
        "--admin-api-key",
        "--drain-timeout",
        "--log-format",
        "--cache-dir",
        # multi-node mode: the server reads them from the LeaderWorkerSet's environment (lws.py)
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
    }
)


MANAGED_FLAGS_RE = re.compile("^(" + "|".join(sorted(MANAGED_FLAGS)) + ")(=.*)?$")


def _check_quantity(value: int | str | None, field: str) -> None:
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{field} must not be negative")
    elif not QUANTITY.match(str(value)):
        raise ValueError(f"{field} must be a non-negative quantity such as 500m, 2, 16Gi")


def _check_labels(labels: dict[str, str], field: str) -> None:
    for key, value in labels.items():
        if not (is_qualified_name(key) and is_label_value(value)):
            raise ValueError(
                f"{field} must map label keys (prefix/name) to label values (63 characters at most)"
            )


def _int_or_percent(value: int | str, field: str, max_percent: int | None = None) -> int | None:
    """The integer, or None for a percentage; refuses what the API server refuses."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field} must be a non-negative number or a percentage like 25%")
        return value
    if not PERCENT.match(value):
        raise ValueError(f"{field} must be a non-negative number or a percentage like 25%")
    if max_percent is not None and int(value[:-1]) > max_percent:
        raise ValueError(f"{field} must not exceed {max_percent}%")
    return None


def is_zero(value: int | str) -> bool:
    return value == 0 or (
        isinstance(value, str) and PERCENT.match(value) is not None and int(value[:-1]) == 0
    )


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class PullSecretRef(_Model):
    """A pod.imagePullSecrets entry (core/v1 LocalObjectReference)."""

    name: str = Field(min_length=1, max_length=253)

    @model_validator(mode="after")
    def _check_name(self) -> PullSecretRef:
        if not is_dns1123_subdomain(self.name):
            raise ValueError("pod.imagePullSecrets entries are {name: <Secret name>}")
        return self


class _SecretRef(_Model):
    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)

    @model_validator(mode="after")
    def _check_names(self) -> _SecretRef:
        if not is_dns1123_subdomain(self.name):
            raise ValueError("a Secret name must be a DNS-1123 subdomain (lower case, digits, '-', '.')")
        if not SECRET_KEY.match(self.key):
            raise ValueError("a Secret key may only hold letters, digits, '-', '_' and '.'")
        return self


class SecretKeyRef(_SecretRef):
    """The hub token's Secret; the key defaults as the CRD defaults it."""

    key: str = Field(default="HF_TOKEN", min_length=1, max_length=253)


class ApiKeySecretRef(_SecretRef):
    key: str = Field(default="API_KEY", min_length=1, max_length=253)


class ModelSource(_Model):
    uri: str = Field(min_length=2, max_length=512)
    revision: str | None = Field(default=None, min_length=1, max_length=128)
    served_name: str | None = Field(default=None, min_length=1, max_length=256)
    credentials_secret_ref: SecretKeyRef | None = None

    @model_validator(mode="after")
    def _check_uri(self) -> ModelSource:
        if not (self.uri.startswith(MODEL_SCHEMES)):
            raise ValueError(URI_MESSAGE)
        if self.uri.startswith("hf://") and not HF_URI.match(self.uri):
            raise ValueError("model.uri hf:// must look like hf://org/name")
        if self.uri.startswith("pvc://") and not PVC_URI.match(self.uri):
            raise ValueError("model.uri pvc:// must look like pvc://claim/path/in/claim")
        if self.uri.startswith("s3://") and not S3_URI.match(self.uri):
            raise ValueError(
                "model.uri s3:// must look like s3://bucket/prefix (a bucket name: lower case, digits, '.', "
                "'-'; no empty, '.' or '..' segments)"
            )
        if self.uri.startswith("oci://") and not OCI_URI.match(self.uri):
            raise ValueError(
                "model.uri oci:// must look like oci://registry/repo:tag or oci://registry/repo@sha256:digest"
            )
        if self.revision is not None and not self.uri.startswith("hf://"):
            raise ValueError("model.revision is only meaningful for hf:// models")
        creds = self.credentials_secret_ref
        if creds is not None and self.uri.startswith("s3://") and creds.key != "HF_TOKEN":
            raise ValueError(
                "model.credentialsSecretRef.key is for hf:// tokens: an s3:// model reads the Secret's keys "
                "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optional AWS_ENDPOINT_URL, AWS_REGION"
            )
        return self


class SpeculativeSpec(_Model):
    """Rendered into the server's --speculative-config (vLLM's JSON keys). `model` (draft_model only):
    the draft's URI in model.uri's forms; it must use the model's tokenizer (checked by the server)."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(ge=1, le=32)
    model: str | None = Field(default=None, min_length=2, max_length=512)
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=64)
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=64)
    disable_by_batch_size: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeSpec:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError("engine.speculative.promptLookupMin must be <= promptLookupMax")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "engine.speculative.model is required by method draft_model and refused by ngram"
            )
        if self.method == "draft_model" and (lo is not None or hi is not None):
            raise ValueError("engine.speculative.promptLookupMin/Max belong to the ngram method")
        if self.model is not None:
            if not self.model.startswith(("hf://", "pvc://", "/")):
                raise ValueError(
                    "engine.speculative.model must start with hf://, pvc:// or / (a path inside the image)"
                )
            if self.model.startswith("hf://") and not HF_URI.match(self.model):
                raise ValueError("engine.speculative.model hf:// must look like hf://org/name")
            if self.model.startswith("pvc://") and not PVC_URI.match(self.model):
                raise ValueError("engine.speculative.model pvc:// must look like pvc://claim/path/in/claim")
        return self

    def to_flag(self) -> str:
        """The JSON the server reads; the draft's URI becomes the path or hub id the server loads."""
        raw = self.model_dump(exclude_none=True)
        if self.model is not None:
            raw["model"] = model_location(self.model).server_model
        return json.dumps(raw, sort_keys=True)


ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class AdapterSpec(_Model):
    """A LoRA adapter (PEFT folder) served on top of the model under `name` (the `model` clients send)."""

    name: str = Field(min_length=1, max_length=128)
    uri: str = Field(min_length=2, max_length=512)
    credentials_secret_ref: SecretKeyRef | None = None

    @model_validator(mode="after")
    def _check(self) -> AdapterSpec:
        if not ADAPTER_NAME.match(self.name):
            raise ValueError("adapters[].name must be letters, digits, '.', '_' or '-'")
        if not (self.uri.startswith(("hf://", "pvc://", "/"))):
            raise ValueError("adapters[].uri must start with hf://, pvc:// or / (a path inside the image)")
        if self.uri.startswith("hf://") and not HF_URI.match(self.uri):
            raise ValueError("adapters[].uri hf:// must look like hf://org/name")
        if self.uri.startswith("pvc://") and not PVC_URI.match(self.uri):
            raise ValueError("adapters[].uri pvc:// must look like pvc://claim/path/in/claim")
        return self


class EngineSpec(_Model):
    image: str | None = Field(default=None, min_length=1, max_length=512)
    quantization: Quantization | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # --task: auto = from the model's config.json (BERT encoders embed, sequence classifiers score)
    task: Literal["auto", "generate", "embed", "score"] = "auto"
    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576)
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096)
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=65536)
    enable_prefix_caching: bool = True
    speculative: SpeculativeSpec | None = None
    tensor_parallel_size: int = Field(default=1, ge=1, le=512)
    api_key_secret_ref: ApiKeySecretRef | None = None
    extra_args: list[str] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _check_engine(self) -> EngineSpec:
        if self.image is not None and not IMAGE_REF.match(self.image):
            raise ValueError(
                "engine.image must be an image reference like registry/repo:tag or repo@sha256:digest"
            )
        if any(MANAGED_FLAGS_RE.match(arg) for arg in self.extra_args):
            raise ValueError(
                "engine.extraArgs must not set a flag the operator manages from the spec "
                "(--model, --port, --served-model-name, --quantize, --dtype, ...)"
            )
        problems = admission.extra_args_errors(self.extra_args)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class GPUSpec(_Model):
    count: int = Field(default=0, ge=0, le=16)
    product: str | None = Field(default=None, min_length=1, max_length=63)
    resource_name: str = Field(default="nvidia.com/gpu", min_length=1, max_length=253)

    @model_validator(mode="after")
    def _check_gpu(self) -> GPUSpec:
        if self.product is not None and not is_label_value(self.product):
            raise ValueError(
                "resources.gpu.product must be a node label value (letters, digits, '-', '_', '.')"
            )
        if not EXTENDED_RESOURCE.match(self.resource_name) or self.resource_name.startswith("kubernetes.io/"):
            raise ValueError(
                "resources.gpu.resourceName must be an extended resource name like nvidia.com/gpu"
            )
        return self


class ResourcesSpec(_Model):
    gpu: GPUSpec = Field(default_factory=GPUSpec)
    cpu: IntOrString | None = None
    memory: IntOrString | None = None

    @model_validator(mode="after")
    def _check_quantities(self) -> ResourcesSpec:
        _check_quantity(self.cpu, "resources.cpu")
        _check_quantity(self.memory, "resources.memory")
        return self


CacheMode = Literal["PerPod", "Shared"]
AccessMode = Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]
# A quantity that is zero ("0", "0Gi", "0.0"): a claim of size zero is refused by the API server.
ZERO_QUANTITY = re.compile(r"^[+]?(0+([.]0*)?|[.]0+)([KMGTPE]i|[numkMGTPE])?$")


class CacheSpec(_Model):
    """Where weights are cached. PerPod (default): each replica downloads into its own emptyDir (or
    into `claimName`, mounted read-write by every replica). Shared (KubeAI's and NIM's cache): one
    claim per model (created from size/storageClassName/accessModes, or `claimName` adopted), filled
    once by a loader Job, mounted read-only by the replicas, which load from it offline."""

    mode: CacheMode = "PerPod"
    claim_name: str | None = Field(default=None, min_length=1, max_length=253)
    size_limit: IntOrString | None = None
    size: IntOrString | None = None
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    access_modes: list[AccessMode] | None = Field(default=None, min_length=1, max_length=3)
    backoff_limit: int = Field(default=4, ge=0, le=20)

    @model_validator(mode="after")
    def _check_cache(self) -> CacheSpec:
        if self.claim_name is not None and not is_dns1123_subdomain(self.claim_name):
            raise ValueError("cache.claimName must be a DNS-1123 subdomain (lower case, digits, '-', '.')")
        _check_quantity(self.size_limit, "cache.sizeLimit")
        if self.size is not None:
            _check_quantity(self.size, "cache.size")
            if ZERO_QUANTITY.match(str(self.size)):
                raise ValueError("cache.size must be above zero")
        if self.storage_class_name is not None and not is_dns1123_subdomain(self.storage_class_name):
            raise ValueError(
                "cache.storageClassName must be a DNS-1123 subdomain (lower case, digits, '-', '.')"
            )
        if self.access_modes is not None and len(set(self.access_modes)) != len(self.access_modes):
            raise ValueError("cache.accessModes must not repeat a mode")
        creates = (
            self.size is not None or self.storage_class_name is not None or self.access_modes is not None
        )
        if self.mode != "Shared" and creates:
            raise ValueError(
                "cache.size, cache.storageClassName and cache.accessModes describe the claim of cache.mode Shared"
            )
        if self.mode == "Shared" and self.claim_name is not None and creates:
            raise ValueError(
                "cache.size, cache.storageClassName and cache.accessModes describe a claim the operator "
                "creates: leave them unset when adopting cache.claimName"
            )
        if self.mode == "Shared" and self.claim_name is None and self.size is None:
            raise ValueError(
                "cache.mode Shared needs cache.size (a claim the operator creates) or cache.claimName "
                "(an existing claim to adopt)"
            )
        return self

    @property
    def shared(self) -> bool:
        return self.mode == "Shared"

    @property
    def single_pod_claim(self) -> bool:
        """The claim the operator creates cannot be mounted by pods on several nodes at once."""
        return self.access_modes is not None and "ReadWriteMany" not in self.access_modes


class ScalingSpec(_Model):
    replicas: int = Field(default=1, ge=0, le=1000)
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int | None = Field(default=None, ge=1, le=1000)
    metric: Metric = "QueueDepth"
    target: float | None = Field(default=None, gt=0)
    autoscaler: Autoscaler = "None"
    scale_down_delay_seconds: int = Field(default=300, ge=0, le=3600)
    prometheus_address: str | None = Field(default=None, min_length=1, max_length=512)
    # Scale to zero (minReplicas 0): the activator's bounds on requests held while the model wakes.
    max_held_requests: int = Field(default=100, ge=1, le=10000)
    max_wait_seconds: int | None = Field(default=None, ge=1, le=86400)

    @model_validator(mode="after")
    def _check_rules(self) -> ScalingSpec:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("scaling.minReplicas must be <= scaling.maxReplicas")
        if self.autoscaler == "None" and (
            self.replicas < self.min_replicas
            or (self.max_replicas is not None and self.replicas > self.max_replicas)
        ):
            raise ValueError(
                "without an autoscaler, scaling.replicas must lie within [minReplicas, maxReplicas]"
            )
        if self.autoscaler != "None" and self.max_replicas is None:
            raise ValueError("an autoscaler needs scaling.maxReplicas")
        if self.autoscaler == "KEDA" and self.prometheus_address is None:
            raise ValueError("scaling.autoscaler KEDA needs scaling.prometheusAddress")
        if self.autoscaler == "HPA" and self.min_replicas < 1:
            raise ValueError("an HPA cannot scale to zero (minReplicas >= 1); use KEDA for scale-to-zero")
        if self.metric == "KVCacheUsage" and self.target is not None and self.target > 1.0:
            raise ValueError("a KVCacheUsage target is a fraction in (0, 1]")
        if self.prometheus_address is not None and not PROMETHEUS_URL.match(self.prometheus_address):
            raise ValueError("scaling.prometheusAddress must be an http:// or https:// URL")
        return self

    @property
    def floor(self) -> int:
        """The fewest replicas this spec runs while not suspended."""
        return self.replicas if self.autoscaler == "None" else self.min_replicas

    @property
    def effective_target(self) -> float:
        """Target per replica; the defaults are where a single server starts to queue."""
        if self.target is not None:
            return self.target
        return {"QueueDepth": 5.0, "KVCacheUsage": 0.8, "RunningRequests": 16.0}[self.metric]


class RolloutSpec(_Model):
    max_surge: IntOrString = 1
    # None: 0 (never below the wanted count) unless maxSurge is 0, then 1 (the API server refuses both 0).
    max_unavailable: IntOrString | None = None
    drain_timeout_seconds: int = Field(default=30, ge=1, le=3600)

    @model_validator(mode="after")
    def _check_rollout(self) -> RolloutSpec:
        _int_or_percent(self.max_surge, "rollout.maxSurge")
        if self.max_unavailable is not None:
            _int_or_percent(self.max_unavailable, "rollout.maxUnavailable", max_percent=100)
            if is_zero(self.max_surge) and is_zero(self.max_unavailable):
                raise ValueError(
                    "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: a rollout could never start"
                )
        return self

    @property
    def effective_max_unavailable(self) -> int | str:
        if self.max_unavailable is not None:
            return self.max_unavailable
        return 1 if is_zero(self.max_surge) else 0


class ProbesSpec(_Model):
    startup_timeout_seconds: int = Field(default=1800, ge=10, le=86400)


class SchedulingSpec(_Model):
    node_selector: LabelMap = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list, max_length=16)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=253)

    @model_validator(mode="after")
    def _check_scheduling(self) -> SchedulingSpec:
        _check_labels(self.node_selector, "scheduling.nodeSelector")
        for field, value in (
            ("priorityClassName", self.priority_class_name),
            ("runtimeClassName", self.runtime_class_name),
        ):
            if value is not None and not is_dns1123_subdomain(value):
                raise ValueError(
                    f"scheduling.{field} must be a DNS-1123 subdomain (lower case, digits, '-', '.')"
                )
        return self


# Names the operator gives the pod's own env vars, volumes, mount paths and labels; a user entry that
# repeated one would silently win or lose against the operator, so it is refused.
MANAGED_ENV = (
    "KUBEINFER_CACHE_DIR",
    "HF_HOME",
    "TRITON_CACHE_DIR",
    "HOME",
    "TMPDIR",
    "MODEL_REVISION",
    "HF_TOKEN",
    "API_KEY",
    "HF_HUB_OFFLINE",
    # injected by the LeaderWorkerSet controller (or the server's default rendezvous port): lws.py
    "LWS_LEADER_ADDRESS",
    "LWS_GROUP_SIZE",
    "LWS_WORKER_INDEX",
    "MASTER_PORT",
)
MANAGED_VOLUMES = ("tmp", "cache", "dshm", "model", "model-cache")
MANAGED_MOUNT_PATHS = ("/tmp", "/var/cache/kubeinfer", "/dev/shm", "/models", "/var/cache/kubeinfer-shared")
MANAGED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)


class PodSpec(_Model):
    """What users set on the server pods beyond the engine (core/v1 objects passed through)."""

    labels: LabelMap = Field(default_factory=dict)
    annotations: Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=64)] = Field(
        default_factory=dict
    )
    service_account_name: str | None = Field(default=None, min_length=1, max_length=253)
    image_pull_secrets: list[PullSecretRef] = Field(default_factory=list, max_length=16)

    @field_validator("annotations")
    @classmethod
    def _check_annotation_keys(cls, annotations: dict[str, str]) -> dict[str, str]:
        # The API server refuses a pod template whose annotation keys are not qualified names.
        bad = [k[:64] for k in annotations if not is_qualified_name(k)]
        if bad:
            raise ValueError(
                f"pod.annotations keys must be qualified names ([prefix/]name): {', '.join(bad)}"
            )
        return annotations

    env: list[dict[str, Any]] = Field(default_factory=list, max_length=128)
    env_from: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    volumes: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    # None: sized by the GPU count (render.shm_size_limit)
    shm_size: IntOrString | None = None

    @model_validator(mode="after")
    def _check_pod(self) -> PodSpec:
        for field, items, key, limit in (
            ("pod.env", self.env, "name", 256),
            ("pod.volumes", self.volumes, "name", 63),
            ("pod.volumeMounts", self.volume_mounts, "name", 63),
            ("pod.volumeMounts", self.volume_mounts, "mountPath", 1024),
            ("pod.envFrom", self.env_from, "prefix", admission.ENV_FROM_PREFIX_MAX),
        ):
            for i, item in enumerate(items):
                if len(str(item.get(key, ""))) > limit:
                    raise ValueError(f"spec.{field}[{i}].{key}: Too long: may not be more than {limit} bytes")
        _check_labels(self.labels, "pod.labels")
        if any(k in MANAGED_LABELS for k in self.labels):
            raise ValueError(
                "pod.labels must not set the app.kubernetes.io labels the operator selects pods by"
            )
        if self.service_account_name is not None and not is_dns1123_subdomain(self.service_account_name):
            raise ValueError(
                "pod.serviceAccountName must be a DNS-1123 subdomain (lower case, digits, '-', '.')"
            )
        if any(e.get("name") in MANAGED_ENV for e in self.env):
            raise ValueError(
                "pod.env must not set a variable the operator sets (HF_TOKEN, API_KEY, HF_HOME, ...)"
            )
        if any(v.get("name") in MANAGED_VOLUMES for v in self.volumes):
            raise ValueError(
                "pod.volumes must not reuse the operator's volume names (tmp, cache, dshm, model, model-cache)"
            )
        if any(m.get("mountPath") in MANAGED_MOUNT_PATHS for m in self.volume_mounts):
            raise ValueError(
                "pod.volumeMounts must not reuse the operator's mount paths "
                "(/tmp, /var/cache/kubeinfer, /dev/shm, /models, /var/cache/kubeinfer-shared)"
            )
        names = {v.get("name") for v in self.volumes}
        if any(m.get("name") not in names for m in self.volume_mounts):
            raise ValueError("every pod.volumeMounts entry must name a volume in pod.volumes")
        problems = admission.pod_errors(
            self.env, self.env_from, self.volumes, self.annotations, self.volume_mounts
        )
        if problems:
            raise ValueError("; ".join(problems))
        _check_quantity(self.shm_size, "pod.shmSize")
        return self


class ServiceMonitorSpec(_Model):
    enabled: bool = True
    interval: str = Field(default="30s", max_length=32, pattern=DURATION.pattern)
    labels: LabelMap = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_sm_labels(self) -> ServiceMonitorSpec:
        _check_labels(self.labels, "monitoring.serviceMonitor.labels")
        return self


class MonitoringSpec(_Model):
    service_monitor: ServiceMonitorSpec = Field(default_factory=ServiceMonitorSpec)


class DisruptionSpec(_Model):
    min_available: IntOrString = 1

    @model_validator(mode="after")
    def _check_disruption(self) -> DisruptionSpec:
        _int_or_percent(self.min_available, "disruption.minAvailable", max_percent=100)
        return self


RoutingPolicy = Literal["cache_aware", "kv_aware", "round_robin", "power_of_two", "consistent_hash"]


class RouterResourcesSpec(_Model):
    cpu: IntOrString = "1"
    memory: IntOrString = "512Mi"


class EndpointPickerSpec(_Model):
    """The Gateway API Inference Extension's endpoint picker (EPP) for the model's InferencePool."""

    image: str | None = Field(default=None, min_length=1, max_length=512)
    replicas: int = Field(default=1, ge=1, le=10)
    # What the gateway does when the picker does not answer (the extension's failureMode).
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"

    @model_validator(mode="after")
    def _check_image(self) -> EndpointPickerSpec:
        if self.image is not None and not IMAGE_REF.match(self.image):
            raise ValueError(
                "routing.gateway.endpointPicker.image must be an image reference like registry/repo:tag "
                "or repo@sha256:digest"
            )
        return self


class GatewayRefSpec(_Model):
    """A Gateway (gateway.networking.k8s.io/v1) an HTTPRoute attaches the model's InferencePool to."""

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(default=None, min_length=1, max_length=63)

    @model_validator(mode="after")
    def _check_ref(self) -> GatewayRefSpec:
        if not is_dns1123_subdomain(self.name):
            raise ValueError("routing.gateway.gatewayRef.name must be a DNS-1123 subdomain")
        if self.namespace is not None and not is_dns1123_label(self.namespace):
            raise ValueError("routing.gateway.gatewayRef.namespace must be a DNS-1123 label")
        return self


class GatewaySpec(_Model):
    """Gateway API Inference Extension routing: an InferencePool selecting the model's pods, its
    endpoint picker, and optionally an HTTPRoute from a named Gateway."""

    enabled: bool = False
    endpoint_picker: EndpointPickerSpec = Field(default_factory=EndpointPickerSpec)
    gateway_ref: GatewayRefSpec | None = None
    # The model's request priority in the server's terms (a request's `priority`: lower first), rendered
    # as the extension's InferenceObjective (higher first) with the sign turned: gateway.py.
    priority: int | None = Field(default=None, ge=-1000, le=1000)


class RoutingSpec(_Model):
    """vLLM's router (vllm-router) in front of the replicas: routes by cache, discovers pods by label;
    and/or the Gateway API Inference Extension's InferencePool (`gateway`)."""

    enabled: bool = False
    policy: RoutingPolicy = "cache_aware"
    replicas: int = Field(default=2, ge=1, le=100)
    image: str | None = Field(default=None, min_length=1, max_length=512)
    resources: RouterResourcesSpec = Field(default_factory=RouterResourcesSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)


class ParallelismSpec(_Model):
    """How one replica spans nodes: `nodes` pods (a LeaderWorkerSet group when > 1), each with
    resources.gpu.count GPUs; engine.tensorParallelSize counts the ranks of all of them."""

    nodes: int = Field(default=1, ge=1, le=32)


class LabelSelectorRequirement(_Model):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=16)

    @model_validator(mode="after")
    def _check_values(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(
                "a matchExpressions entry: In and NotIn need values, Exists and DoesNotExist none"
            )
        return self


class LabelSelector(_Model):
    """metav1.LabelSelector, bounded like the CRD's schema."""

    match_labels: dict[str, str] = Field(default_factory=dict, max_length=16)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=8)

    @model_validator(mode="after")
    def _check_selector(self) -> LabelSelector:
        _check_labels(self.match_labels, "a matchLabels selector")
        return self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.match_labels:
            out["matchLabels"] = dict(self.match_labels)
        if self.match_expressions:
            out["matchExpressions"] = [
                e.model_dump(by_alias=True, exclude_defaults=True) for e in self.match_expressions
            ]
        return out


NETWORK_PEER_MESSAGE = "network.allowedClients entries need a namespaceSelector, a podSelector or both"


class NetworkPeer(_Model):
    """A NetworkPolicy peer: pods matching podSelector in namespaces matching namespaceSelector (one
    alone: that selector in the model's namespace, or all pods of the matching namespaces)."""

    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.namespace_selector is not None:
            out["namespaceSelector"] = self.namespace_selector.to_dict()
        if self.pod_selector is not None:
            out["podSelector"] = self.pod_selector.to_dict()
        return out


class NetworkSpec(_Model):
    """Who may reach the pods (netpol.py renders the NetworkPolicies)."""

    # False: no NetworkPolicy for this model (the namespace's own policies apply)
    network_policy: bool = True
    # peers allowed on the serving ports; empty: the model's namespace. The model's router, the
    # operator and Prometheus are always allowed.
    allowed_clients: list[NetworkPeer] = Field(default_factory=list, max_length=16)

    @model_validator(mode="after")
    def _check_network(self) -> NetworkSpec:
        if any(p.namespace_selector is None and p.pod_selector is None for p in self.allowed_clients):
            raise ValueError(NETWORK_PEER_MESSAGE)
        return self


class CanarySpec(_Model):
    """A second version of the model served beside the stable one (canary.py renders it): `weight`
    percent of the gateway's traffic (the HTTPRoute's weighted backendRefs, as KServe's
    canaryTrafficPercent) goes to `replicas` pods of `model`. Promotion is an edit: move canary.model
    into model and drop canary."""

    model: ModelSource
    weight: int = Field(ge=0, le=100)
    replicas: int = Field(default=1, ge=0, le=100)


class InferenceModelSpec(_Model):
    model: ModelSource
    canary: CanarySpec | None = None
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=64)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    probes: ProbesSpec = Field(default_factory=ProbesSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    disruption: DisruptionSpec = Field(default_factory=DisruptionSpec)
    pod: PodSpec = Field(default_factory=PodSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    suspend: bool = False

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> InferenceModelSpec:
        gpus = self.resources.gpu.count
        nodes = self.parallelism.nodes
        if nodes > 1 and gpus < 1:
            raise ValueError(
                "parallelism.nodes > 1 needs resources.gpu.count >= 1 (one tensor-parallel rank per GPU)"
            )
        if self.engine.tensor_parallel_size != (gpus if gpus > 0 else 1) * nodes:
            raise ValueError(
                "engine.tensorParallelSize must equal resources.gpu.count x parallelism.nodes "
                "(1 without GPUs)"
            )
        return self

    @model_validator(mode="after")
    def _check_evictable(self) -> InferenceModelSpec:
        floor = self.scaling.floor
        min_available = self.disruption.min_available
        forbids_all = min_available == "100%" if isinstance(min_available, str) else min_available >= floor
        if floor > 1 and forbids_all:
            raise ValueError(
                "disruption.minAvailable must leave a pod evictable: below the replica count "
                "(minReplicas when autoscaled) and below 100%"
            )
        return self

    @model_validator(mode="after")
    def _check_cache_fits(self) -> InferenceModelSpec:
        if self.model.uri.startswith("s3://") and not self.cache.shared:
            raise ValueError(
                "an s3:// model needs cache.mode Shared: its loader Job downloads it (with the credentials, "
                "which the server pods never get)"
            )
        if not self.cache.shared:
            return self
        if not self.model.uri.startswith(("hf://", "s3://")):
            raise ValueError(
                "cache.mode Shared downloads hf:// and s3:// models: a pvc://, oci:// or image path needs no cache"
            )
        if self.cache.single_pod_claim and self.max_pods > 1:
            raise ValueError(
                "cache.accessModes without ReadWriteMany serve one pod, and more can run (replicas or "
                "maxReplicas above 1, or a rollout's maxSurge): use ReadWriteMany, or one replica with "
                "rollout.maxSurge 0"
            )
        return self

    @model_validator(mode="after")
    def _check_objective_policy(self) -> InferenceModelSpec:
        gateway = self.routing.gateway
        if not gateway.enabled or gateway.priority is None:
            return self
        args = list(self.engine.extra_args)
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag != "--scheduling-policy":
                continue
            policy = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if policy != "priority":
                # the server refuses --objective-priority under fcfs and would not start
                raise ValueError(
                    "engine.extraArgs must not set --scheduling-policy other than priority with "
                    "routing.gateway.priority (the operator sets priority scheduling for it)"
                )
        return self

    @model_validator(mode="after")
    def _check_canary(self) -> InferenceModelSpec:
        for message in canary_errors(self):
            raise ValueError(message)
        return self

    @property
    def max_pods(self) -> int:
        """The most server pods that can run at once, ignoring suspend (it may be lifted): the count
        (maxReplicas when autoscaled), plus at least one more during a rollout unless maxSurge is 0."""
        scaling = self.scaling
        ceiling = scaling.replicas if scaling.autoscaler == "None" else (scaling.max_replicas or 2)
        if ceiling == 0:
            return 0
        return ceiling + (0 if is_zero(self.rollout.max_surge) else 1)

    @property
    def autoscaled(self) -> bool:
        return self.scaling.autoscaler != "None" and not self.suspend

    @property
    def scale_to_zero(self) -> bool:
        """minReplicas 0 with KEDA, or without an autoscaler and a wake count (replicas) of at least
        one: the activator holds requests at zero replicas and wakes the model (activator.py)."""
        scaling = self.scaling
        if self.suspend or scaling.min_replicas != 0:
            return False
        if scaling.autoscaler == "KEDA":
            return True
        return scaling.autoscaler == "None" and scaling.replicas >= 1

    @property
    def replicas_delegated(self) -> bool:
        """The workload's spec.replicas is written by an autoscaler or by the activator (built-in
        scale to zero), through its scale subresource; the operator's apply leaves it out."""
        return self.autoscaled or self.scale_to_zero

    @property
    def served_name(self) -> str:
        if self.model.served_name:
            return self.model.served_name
        return model_location(self.model.uri).default_served_name


def canary_errors(spec: InferenceModelSpec) -> list[str]:
    """Why spec.canary cannot be served as written (the CRD's CEL rules say the same, in this order)."""
    canary = spec.canary
    if canary is None:
        return []
    gateway = spec.routing.gateway
    if not (gateway.enabled and gateway.gateway_ref is not None):
        return [
            "canary needs routing.gateway.enabled with a gatewayRef: the weighted HTTPRoute over the two "
            "InferencePools is what splits the traffic (a plain Service cannot weigh two Deployments)"
        ]
    if spec.routing.enabled:
        return ["canary cannot be combined with routing.enabled: vllm-router has no per-worker weights"]
    if canary.model.uri.startswith("s3://") or spec.cache.shared:
        return [
            "canary cannot be combined with cache.mode Shared or an s3:// canary.model (one loader per model)"
        ]
    if spec.parallelism.nodes > 1:
        return ["canary cannot be combined with parallelism.nodes > 1"]
    if spec.scaling.min_replicas == 0:
        return ["canary cannot be combined with scaling to zero (scaling.minReplicas 0)"]
    if canary.model.served_name is not None and canary.model.served_name != spec.model.served_name:
        return [
            "canary.model.servedName, if set, must equal model.servedName (clients call both versions by one name)"
        ]
    return []


class Condition(_Model):
    type: Literal[
        "Ready",
        "Progressing",
        "Degraded",
        "MonitoringAvailable",
        "AutoscalingAvailable",
        "CacheReady",
        "GatewayAvailable",
        "CanaryReady",
        "MemorySufficient",
    ]
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str


Phase = Literal["Pending", "Loading", "Ready", "Degraded", "Suspended", "Failed", "ScaledToZero", "Waking"]
CachePhase = Literal["Pending", "Loading", "Ready", "Failed"]


class CacheStatus(_Model):
    """The shared model cache (cache.mode Shared): its claim, the loader Job and how far it got."""

    phase: CachePhase
    claim_name: str
    job_name: str | None = None
    reason: str = ""
    message: str = ""


class MemoryEstimateStatus(_Model):
    """The model's memory estimate as last read from its loader (server/memory_estimate.py, bytes), kept
    so that a deleted loader pod does not take it away; `loader_job` names the load it belongs to (its
    digest covers the model, revision, hub adapters and the serving flags the estimate reads), so a
    changed model no longer matches it. `pod_bytes`: what the operator derives for each server pod's
    memory (memory.py); `gpu_bytes`: for each GPU of a GPU pod (weights shard + KV allocation)."""

    loader_job: str
    model: str
    revision: str | None = None
    format: str = ""  # "safetensors" | "gguf" (the estimate's source), "" when the loader did not say
    total_bytes: int = Field(ge=0)
    minimum_bytes: int = Field(ge=0)
    weight_bytes: int = Field(ge=0)
    file_weight_bytes: int = Field(ge=0)
    kv_cache_bytes: int = Field(ge=0)
    pod_bytes: int = Field(ge=0)
    gpu_bytes: int | None = Field(default=None, ge=0)


class CanaryStatus(_Model):
    """spec.canary as served: its source, its share of the gateway's traffic and its replicas."""

    model: str  # canary.model.uri
    weight: int
    replicas: int = 0
    ready_replicas: int = 0
    desired_replicas: int = 0


class InferenceModelStatus(_Model):
    phase: Phase
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: str | None = None
    endpoint: str | None = None
    observed_generation: int | None = None
    # LoRA adapters served (adapter_sync.py reads them from the pods), and their count for the printer
    # column; None = not reported by this write (the previous value stays).
    adapters: list[str] | None = None
    adapter_count: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    cache: CacheStatus | None = None
    canary: CanaryStatus | None = None
    memory_estimate: MemoryEstimateStatus | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


@dataclass(frozen=True)
class ModelLocation:
    """Where the server finds its weights, parsed from `spec.model.uri`."""

    scheme: Literal["hf", "pvc", "s3", "oci", "image"]
    server_model: str  # the value of --model
    claim_name: str | None = None  # pvc:// only
    default_served_name: str = ""


MODEL_MOUNT_ROOT = "/models"
# Where an oci:// model's image volume is mounted (read-only) in the server container.
OCI_MOUNT_PATH = f"{MODEL_MOUNT_ROOT}/oci"


def model_location(uri: str) -> ModelLocation:
    if uri.startswith("hf://"):
        repo = uri.removeprefix("hf://")
        return ModelLocation(scheme="hf", server_model=repo, default_served_name=repo)
    if uri.startswith("s3://"):
        # The loader Job downloads it into the shared cache; deployment.py passes that folder as --model.
        prefix = uri.removeprefix("s3://").rstrip("/")
        return ModelLocation(scheme="s3", server_model="", default_served_name=prefix.rsplit("/", 1)[-1])
    if uri.startswith("oci://"):
        reference = uri.removeprefix("oci://")
        repo = reference.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
        return ModelLocation(scheme="oci", server_model=OCI_MOUNT_PATH, default_served_name=repo)
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        mount = f"{MODEL_MOUNT_ROOT}/{claim}"
        server_model = f"{mount}/{path}" if path else mount
        return ModelLocation(
            scheme="pvc",
            server_model=server_model.rstrip("/"),
            claim_name=claim,
            default_served_name=(path.rstrip("/").rsplit("/", 1)[-1] or claim),
        )
    return ModelLocation(
        scheme="image", server_model=uri, default_served_name=uri.rstrip("/").rsplit("/", 1)[-1]
    )


class InvalidSpecError(ValueError):
    """The spec passed the schema but cannot be deployed; the message says why."""


@dataclass(frozen=True)
class InferenceModel:
    """An InferenceModel as the renderers see it: identity plus the validated spec."""

    name: str
    namespace: str
    spec: InferenceModelSpec
    uid: str | None = None  # None when rendering offline: no owner references then
    generation: int | None = None
    # "canary": canary.canary_view's rendering of spec.canary (its children are `<child>-canary`).
    variant: Literal["stable", "canary"] = "stable"

    @property
    def child_name(self) -> str:
        """Name of every child object of this variant (a DNS-1035 label derived from `name`, see
        names.child_name; `<that>-canary` for the canary's)."""
        base = child_name(self.name)
        return derived_name(base, "canary") if self.variant == "canary" else base

    @property
    def base_child_name(self) -> str:
        """The stable variant's child name: what both variants share (ServiceAccount, admin key, adapters)."""
        return child_name(self.name)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], default_namespace: str = "default") -> InferenceModel:
        if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != KIND:
            raise InvalidSpecError(f"expected apiVersion {API_VERSION} kind {KIND}")
        meta = manifest.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise InvalidSpecError("metadata.name is required")
        try:
            spec = InferenceModelSpec.model_validate(manifest.get("spec") or {})
        except ValidationError as exc:
            raise InvalidSpecError("\n".join([*bound_errors(exc), str(exc)])) from exc
        except ValueError as exc:
            raise InvalidSpecError(str(exc)) from exc
        return cls(
            name=name,
            namespace=meta.get("namespace") or default_namespace,
            spec=spec,
            uid=meta.get("uid"),
            generation=meta.get("generation"),
        )


def bound_errors(exc: ValidationError) -> list[str]:
    """The CRD's maxItems/maxProperties/maxLength refusals in the API server's words (seen on v1.36.2:
    `spec.pod.labels: Too many: 65: must have at most 64 items`, `spec.rollout.maxSurge: Too long: may not
    be more than 64 bytes`), so that `render` says what `kubectl apply` would."""
    out = []
    for err in exc.errors():
        # loc: field aliases and list indexes, plus pydantic's union-member tags ("constrained-str")
        parts = [
            p for p in err["loc"] if isinstance(p, int) or ("-" not in p and "[" not in p and p != "int")
        ]
        path = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
        limit = (err.get("ctx") or {}).get("max_length")
        if err["type"] == "too_long":
            out.append(f"{path}: Too many: {len(err['input'])}: must have at most {limit} items")
        elif err["type"] == "string_too_long":
            out.append(f"{path}: Too long: may not be more than {limit} bytes")
    return out


def semantic_errors(spec: InferenceModelSpec) -> list[str]:
    """Problems the schema cannot express; each makes the spec undeployable. A canary is checked as
    the model it is (its claim against the adapters' and the draft's, its token against theirs)."""
    if spec.canary is not None:
        model = spec.canary.model.model_copy(update={"served_name": spec.served_name})
        canary_spec = spec.model_copy(update={"model": model, "canary": None})
        return _semantic_errors(spec) + [f"canary: {e}" for e in _semantic_errors(canary_spec)]
    return _semantic_errors(spec)


def _semantic_errors(spec: InferenceModelSpec) -> list[str]:
    errors: list[str] = []
    names = [a.name for a in spec.adapters]
    if len(set(names)) != len(names):
        errors.append("adapters[].name must be unique")
    if spec.served_name in names:
        errors.append(f"adapter name {spec.served_name!r} is the model's served name")
    model_claim = model_location(spec.model.uri).claim_name
    draft = spec.engine.speculative.model if spec.engine.speculative is not None else None
    draft_claim = model_location(draft).claim_name if draft is not None else None
    if draft_claim is not None and draft_claim != model_claim:
        errors.append(
            f"engine.speculative.model: a pvc:// draft must live on the model's claim ({model_claim})"
        )
    for a in spec.adapters:
        claim = model_location(a.uri).claim_name
        if claim is not None and claim != model_claim:
            errors.append(f"adapter {a.name}: pvc:// adapters must live on the model's claim ({model_claim})")
        if a.credentials_secret_ref is not None and spec.model.uri.startswith("s3://"):
            errors.append(
                f"adapter {a.name}: credentialsSecretRef: an s3:// model's Secret holds S3 keys, not a hub token"
            )
        # the pod has one hub token (HF_TOKEN): an adapter may only use the model's
        elif (
            a.credentials_secret_ref is not None
            and a.credentials_secret_ref != spec.model.credentials_secret_ref
        ):
            errors.append(
                f"adapter {a.name}: credentialsSecretRef must be the model's (one hub token per pod)"
            )
    return errors
