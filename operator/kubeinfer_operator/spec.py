"""Pydantic models of the InferenceModel custom resource (spec and status).

These mirror crds/kubeinfer.dev_inferencemodels.yaml field for field (tests check the two stay in step).
The CRD's CEL rules are repeated here as model validators so that `render` without a cluster rejects
exactly what the API server would reject.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kubeinfer.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceModel"
PLURAL = "inferencemodels"

DEFAULT_SERVER_IMAGE = "ghcr.io/kubeinfer/server:0.1.0"
OPERATOR_IMAGE = "ghcr.io/kubeinfer/operator:0.1.0"

Quantization = Literal[
    "awq", "gptq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8", "int8", "int4"
]
Metric = Literal["QueueDepth", "KVCacheUsage", "RunningRequests"]
Autoscaler = Literal["HPA", "KEDA", "None"]

# The patterns also appear in the CRD's CEL rules; keep them identical.
HF_URI = re.compile(r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
PVC_URI = re.compile(r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?$")
IMAGE_PATH = re.compile(r"^/.+$")
DURATION = re.compile(r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")

# Flags the operator sets itself; an extraArgs entry that repeats one would silently fight the operator.
MANAGED_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--quantize",
        "--dtype",
        "--max-total-tokens",
        "--max-num-seqs",
        "--max-concurrent-requests",
        "--enable-prefix-caching",
        "--api-key",
        "--drain-timeout",
        "--log-format",
        "--cache-dir",
        "--enable-lora",
        "--lora-modules",
    }
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class ModelSource(_Model):
    uri: str = Field(min_length=2, max_length=512)
    revision: str | None = Field(default=None, min_length=1, max_length=128)
    served_name: str | None = Field(default=None, min_length=1, max_length=256)
    credentials_secret_ref: SecretKeyRef | None = None

    @model_validator(mode="after")
    def _check_uri(self) -> ModelSource:
        if not (self.uri.startswith(("hf://", "pvc://", "/"))):
            raise ValueError("model.uri must start with hf://, pvc:// or / (a path inside the image)")
        if self.uri.startswith("hf://") and not HF_URI.match(self.uri):
            raise ValueError("model.uri hf:// must look like hf://org/name")
        if self.uri.startswith("pvc://") and not PVC_URI.match(self.uri):
            raise ValueError("model.uri pvc:// must look like pvc://claim/path/in/claim")
        if self.revision is not None and not self.uri.startswith("hf://"):
            raise ValueError("model.revision is only meaningful for hf:// models")
        return self


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
    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576)
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096)
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=65536)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(default=1, ge=1, le=16)
    api_key_secret_ref: SecretKeyRef | None = None
    extra_args: list[str] = Field(default_factory=list, max_length=64)


class GPUSpec(_Model):
    count: int = Field(default=1, ge=0, le=16)
    product: str | None = Field(default=None, min_length=1, max_length=128)
    resource_name: str = Field(default="nvidia.com/gpu", min_length=1, max_length=253)


class ResourcesSpec(_Model):
    gpu: GPUSpec = Field(default_factory=GPUSpec)
    cpu: int | str | None = None
    memory: int | str | None = None


class CacheSpec(_Model):
    claim_name: str | None = Field(default=None, min_length=1, max_length=253)
    size_limit: int | str | None = None


class ScalingSpec(_Model):
    replicas: int = Field(default=1, ge=0, le=1000)
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int | None = Field(default=None, ge=1, le=1000)
    metric: Metric = "QueueDepth"
    target: float | None = Field(default=None, gt=0)
    autoscaler: Autoscaler = "None"
    scale_down_delay_seconds: int = Field(default=300, ge=0, le=3600)
    prometheus_address: str | None = Field(default=None, min_length=1, max_length=512)

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
        return self

    @property
    def effective_target(self) -> float:
        """Target per replica; the defaults are where a single server starts to queue."""
        if self.target is not None:
            return self.target
        return {"QueueDepth": 5.0, "KVCacheUsage": 0.8, "RunningRequests": 16.0}[self.metric]


class RolloutSpec(_Model):
    max_surge: int | str = 1
    max_unavailable: int | str = 0
    drain_timeout_seconds: int = Field(default=30, ge=1, le=3600)


class ProbesSpec(_Model):
    startup_timeout_seconds: int = Field(default=1800, ge=10, le=86400)


class SchedulingSpec(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=253)


class ServiceMonitorSpec(_Model):
    enabled: bool = True
    interval: str = Field(default="30s", pattern=DURATION.pattern)
    labels: dict[str, str] = Field(default_factory=dict)


class MonitoringSpec(_Model):
    service_monitor: ServiceMonitorSpec = Field(default_factory=ServiceMonitorSpec)


class DisruptionSpec(_Model):
    min_available: int | str = 1


class InferenceModelSpec(_Model):
    model: ModelSource
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
    suspend: bool = False

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> InferenceModelSpec:
        gpus = self.resources.gpu.count
        expected = gpus if gpus > 0 else 1
        if self.engine.tensor_parallel_size != expected:
            raise ValueError("engine.tensorParallelSize must equal resources.gpu.count (1 without GPUs)")
        return self

    @property
    def autoscaled(self) -> bool:
        return self.scaling.autoscaler != "None" and not self.suspend

    @property
    def served_name(self) -> str:
        if self.model.served_name:
            return self.model.served_name
        return model_location(self.model.uri).default_served_name


class Condition(_Model):
    type: Literal["Ready", "Progressing", "Degraded", "MonitoringAvailable"]
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str


Phase = Literal["Pending", "Loading", "Ready", "Degraded", "Suspended", "Failed"]


class InferenceModelStatus(_Model):
    phase: Phase
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: str | None = None
    endpoint: str | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


@dataclass(frozen=True)
class ModelLocation:
    """Where the server finds its weights, parsed from `spec.model.uri`."""

    scheme: Literal["hf", "pvc", "image"]
    server_model: str  # the value of --model
    claim_name: str | None = None  # pvc:// only
    default_served_name: str = ""


MODEL_MOUNT_ROOT = "/models"


def model_location(uri: str) -> ModelLocation:
    if uri.startswith("hf://"):
        repo = uri.removeprefix("hf://")
        return ModelLocation(scheme="hf", server_model=repo, default_served_name=repo)
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
        except ValueError as exc:  # pydantic.ValidationError is a ValueError
            raise InvalidSpecError(str(exc)) from exc
        return cls(
            name=name,
            namespace=meta.get("namespace") or default_namespace,
            spec=spec,
            uid=meta.get("uid"),
            generation=meta.get("generation"),
        )


def semantic_errors(spec: InferenceModelSpec) -> list[str]:
    """Problems the schema cannot express; each makes the spec undeployable."""
    errors: list[str] = []
    for arg in spec.engine.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            errors.append(f"engine.extraArgs sets {flag}, which the operator manages from the spec")
    names = [a.name for a in spec.adapters]
    if len(set(names)) != len(names):
        errors.append("adapters[].name must be unique")
    if spec.served_name in names:
        errors.append(f"adapter name {spec.served_name!r} is the model's served name")
    model_claim = model_location(spec.model.uri).claim_name
    for a in spec.adapters:
        claim = model_location(a.uri).claim_name
        if claim is not None and claim != model_claim:
            errors.append(f"adapter {a.name}: pvc:// adapters must live on the model's claim ({model_claim})")
        # the pod has one hub token (HF_TOKEN): an adapter may only use the model's
        if (
            a.credentials_secret_ref is not None
            and a.credentials_secret_ref != spec.model.credentials_secret_ref
        ):
            errors.append(
                f"adapter {a.name}: credentialsSecretRef must be the model's (one hub token per pod)"
            )
    if spec.engine.tensor_parallel_size > 1:
        errors.append(
            "engine.tensorParallelSize > 1 is not supported by the server image (one device per replica)"
        )
    return errors
