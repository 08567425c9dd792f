"""The cluster administrator's admission policy applied to one InferenceModel (admission.py says
what it covers); checked at reconcile time, a refusal becomes the model's InvalidSpec condition."""

from __future__ import annotations

from .admission import AdmissionPolicy, pod_secret_names, policy_errors
from .defaults import ClusterDefaults
from .spec import InferenceModel


def model_policy_errors(im: InferenceModel, policy: AdmissionPolicy, defaults: ClusterDefaults) -> list[str]:
    spec = im.spec
    gateway = spec.routing.gateway
    images = [
        i
        for i in (
            spec.engine.image,
            spec.routing.image if spec.routing.enabled else None,
            gateway.endpoint_picker.image if gateway.enabled else None,
        )
        if i
    ]
    return policy_errors(
        policy,
        images=images,
        default_images=(defaults.server_image, defaults.router_image, defaults.endpoint_picker_image),
        service_account=spec.pod.service_account_name,
        secrets=pod_secret_names(spec.pod.env, spec.pod.env_from, spec.pod.volumes),
    )
