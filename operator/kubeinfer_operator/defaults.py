"""Installation-wide defaults of the pods the operator creates, read from the operator's environment.

The chart sets them from `global.imageRegistry`, `server.image`, `router.image` and
`global.imagePullSecrets`, so a cluster behind a registry mirror needs no `spec.engine.image` on each
InferenceModel. An InferenceModel's own image and pull secrets still come first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .names import is_dns1123_subdomain
from .spec import DEFAULT_ROUTER_IMAGE, DEFAULT_SERVER_IMAGE, IMAGE_REF, OPERATOR_IMAGE

SERVER_IMAGE_ENV = "KUBEINFER_DEFAULT_SERVER_IMAGE"
ROUTER_IMAGE_ENV = "KUBEINFER_DEFAULT_ROUTER_IMAGE"
ACTIVATOR_IMAGE_ENV = "KUBEINFER_DEFAULT_ACTIVATOR_IMAGE"  # the operator's own image (scale to zero)
PULL_SECRETS_ENV = "KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS"  # Secret names, comma-separated


@dataclass(frozen=True)
class ClusterDefaults:
    """Raises ValueError for an image that is not an image reference or a Secret name that is not a
    DNS-1123 subdomain (the pods would never start, so the operator refuses to start instead)."""

    server_image: str = DEFAULT_SERVER_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE
    image_pull_secrets: tuple[str, ...] = ()
    activator_image: str = OPERATOR_IMAGE

    def __post_init__(self) -> None:
        for env, image in (
            (SERVER_IMAGE_ENV, self.server_image),
            (ROUTER_IMAGE_ENV, self.router_image),
            (ACTIVATOR_IMAGE_ENV, self.activator_image),
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
            router_image=env.get(ROUTER_IMAGE_ENV) or DEFAULT_ROUTER_IMAGE,
            image_pull_secrets=secrets,
            activator_image=env.get(ACTIVATOR_IMAGE_ENV) or OPERATOR_IMAGE,
        )

    def pull_secrets(self, own: list[str]) -> list[dict[str, str]]:
        """A pod's imagePullSecrets: its own names first, then the defaults, each name once."""
        return [{"name": n} for n in dict.fromkeys([*own, *self.image_pull_secrets])]
