"""Installation-wide defaults of the pods the operator creates, read from the operator's environment.

The chart sets them from `global.imageRegistry`, `server.image`, `server.cpuImage`, `router.image` and
`global.imagePullSecrets`, so a cluster behind a registry mirror needs no `spec.engine.image` on each
InferenceModel. An InferenceModel's own image and pull secrets still come first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .names import is_dns1123_subdomain
from .spec import (
    DEFAULT_ENDPOINT_PICKER_IMAGE,
    DEFAULT_ROUTER_IMAGE,
    DEFAULT_SERVER_CPU_IMAGE,
    DEFAULT_SERVER_IMAGE,
    IMAGE_REF,
    OPERATOR_IMAGE,
)

SERVER_IMAGE_ENV = "KUBEINFER_DEFAULT_SERVER_IMAGE"
SERVER_CPU_IMAGE_ENV = "KUBEINFER_DEFAULT_SERVER_CPU_IMAGE"
ROUTER_IMAGE_ENV = "KUBEINFER_DEFAULT_ROUTER_IMAGE"
ENDPOINT_PICKER_IMAGE_ENV = "KUBEINFER_DEFAULT_ENDPOINT_PICKER_IMAGE"  # spec.routing.gateway
INFERENCE_EXTENSION_ENV = "KUBEINFER_INFERENCE_EXTENSION"  # "true": render InferencePools (chart value)
ACTIVATOR_IMAGE_ENV = "KUBEINFER_DEFAULT_ACTIVATOR_IMAGE"  # the operator's own image (scale to zero)
PULL_SECRETS_ENV = "KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS"  # Secret names, comma-separated
# the installation's key that each model's admin API key is derived from (credentials.py)
MANAGEMENT_KEY_ENV = "KUBEINFER_MANAGEMENT_KEY"
# Who the model pods' NetworkPolicies let in besides their clients (netpol.py): the operator (its
# namespace, the chart's POD_NAMESPACE, and its pods' labels) and Prometheus (namespace, pod labels).
OPERATOR_NAMESPACE_ENV = "POD_NAMESPACE"
OPERATOR_POD_LABELS_ENV = "KUBEINFER_OPERATOR_POD_LABELS"  # k=v,k=v
MONITORING_NAMESPACE_ENV = "KUBEINFER_MONITORING_NAMESPACE"
PROMETHEUS_POD_LABELS_ENV = "KUBEINFER_PROMETHEUS_POD_LABELS"  # k=v,k=v; empty: any pod there
DEFAULT_OPERATOR_POD_LABELS = (("app.kubernetes.io/name", "kubeinfer"),)
DEFAULT_PROMETHEUS_POD_LABELS = (("app.kubernetes.io/name", "prometheus"),)


def _labels(value: str | None, default: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    if value is None:
        return default
    pairs = [p.strip().partition("=") for p in value.split(",") if p.strip()]
    return tuple((k.strip(), v.strip()) for k, _, v in pairs)


@dataclass(frozen=True)
class ClusterDefaults:
    """Raises ValueError for an image that is not an image reference or a Secret name that is not a
    DNS-1123 subdomain (the pods would never start, so the operator refuses to start instead)."""

    server_image: str = DEFAULT_SERVER_IMAGE
    server_cpu_image: str = DEFAULT_SERVER_CPU_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE
    image_pull_secrets: tuple[str, ...] = ()
    management_key: str | None = field(default=None, repr=False)
    operator_namespace: str | None = None  # None: operator pods in any namespace (no chart)
    operator_pod_labels: tuple[tuple[str, str], ...] = DEFAULT_OPERATOR_POD_LABELS
    monitoring_namespace: str = "monitoring"
    prometheus_pod_labels: tuple[tuple[str, str], ...] = DEFAULT_PROMETHEUS_POD_LABELS
    activator_image: str = OPERATOR_IMAGE
    endpoint_picker_image: str = DEFAULT_ENDPOINT_PICKER_IMAGE
    inference_extension: bool = False

    def __post_init__(self) -> None:
        for env, image in (
            (SERVER_IMAGE_ENV, self.server_image),
            (SERVER_CPU_IMAGE_ENV, self.server_cpu_image),
            (ROUTER_IMAGE_ENV, self.router_image),
            (ACTIVATOR_IMAGE_ENV, self.activator_image),
            (ENDPOINT_PICKER_IMAGE_ENV, self.endpoint_picker_image),
        ):
            if not IMAGE_REF.match(image):
                raise ValueError(f"{env}={image!r} is not an image reference like registry/repo:tag")
        for name in self.image_pull_secrets:
            if not is_dns1123_subdomain(name):
                raise ValueError(f"{PULL_SECRETS_ENV}: {name!r} is not a Secret name")

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> ClusterDefaults:
        """Unset or empty variables keep the built-in defaults."""
        secrets = tuple(
            dict.fromkeys(s.strip() for s in env.get(PULL_SECRETS_ENV, "").split(",") if s.strip())
        )
        return cls(
            server_image=env.get(SERVER_IMAGE_ENV) or DEFAULT_SERVER_IMAGE,
            server_cpu_image=env.get(SERVER_CPU_IMAGE_ENV) or DEFAULT_SERVER_CPU_IMAGE,
            router_image=env.get(ROUTER_IMAGE_ENV) or DEFAULT_ROUTER_IMAGE,
            image_pull_secrets=secrets,
            management_key=env.get(MANAGEMENT_KEY_ENV) or None,
            operator_namespace=env.get(OPERATOR_NAMESPACE_ENV) or None,
            operator_pod_labels=_labels(env.get(OPERATOR_POD_LABELS_ENV), DEFAULT_OPERATOR_POD_LABELS),
            monitoring_namespace=env.get(MONITORING_NAMESPACE_ENV) or "monitoring",
            prometheus_pod_labels=_labels(env.get(PROMETHEUS_POD_LABELS_ENV), DEFAULT_PROMETHEUS_POD_LABELS),
            activator_image=env.get(ACTIVATOR_IMAGE_ENV) or OPERATOR_IMAGE,
            endpoint_picker_image=env.get(ENDPOINT_PICKER_IMAGE_ENV) or DEFAULT_ENDPOINT_PICKER_IMAGE,
            inference_extension=(env.get(INFERENCE_EXTENSION_ENV) or "").strip().lower() == "true",
        )

    def server_image_for(self, gpus: int) -> str:
        """The default server image of a pod with `gpus` GPUs: the CUDA build, or the CPU build for 0
        (torch without CUDA, the C++ kernels prebuilt per x86-64 level, the embedded model inside)."""
        return self.server_image if gpus > 0 else self.server_cpu_image

    def pull_secrets(self, own: list[str]) -> list[dict[str, str]]:
        """A pod's imagePullSecrets: its own names first, then the defaults, each name once."""
        return [{"name": n} for n in dict.fromkeys([*own, *self.image_pull_secrets])]
