"""The cluster administrator's admission policy applied to one InferenceModel (admission.py says
what it covers); checked at reconcile time, a refusal becomes the model's InvalidSpec condition."""

from __future__ import annotations

from .admission import (
    AdmissionPolicy,
    credential_volume_errors,
    pod_secret_names,
    policy_errors,
    scheduling_errors,
)
from .defaults import ClusterDefaults
from .spec import InferenceModel

# Every place of the spec that names a Secret (the CRD's paths); all go through the administrator's
# Secret policy: a designated one as much as a pod-level one, since the pods send a designated
# token to a host (issue 45 item 1). tests/operator/test_op_admission_policy.py holds that every
# CRD field whose name says Secret is here.
SECRET_REF_FIELDS = (
    "spec.model.credentialsSecretRef",
    "spec.canary.model.credentialsSecretRef",
    "spec.adapters[].credentialsSecretRef",
    "spec.engine.apiKeySecretRef",
    "spec.pod.imagePullSecrets",
    "spec.pod.env[].valueFrom.secretKeyRef",
    "spec.pod.envFrom[].secretRef",
    "spec.pod.volumes[].secret",
    "spec.pod.volumes[].projected.sources[].secret",
)


def model_secret_names(im: InferenceModel) -> list[str]:
    """The Secrets of every SECRET_REF_FIELDS entry, in that order, each once."""
    spec = im.spec
    canary = spec.canary.model.credentials_secret_ref if spec.canary is not None else None
    refs = [spec.model.credentials_secret_ref, canary, *(a.credentials_secret_ref for a in spec.adapters)]
    names = [r.name for r in refs if r is not None]
    if spec.engine.api_key_secret_ref is not None:
        names.append(spec.engine.api_key_secret_ref.name)
    names += [p.name for p in spec.pod.image_pull_secrets]
    names += pod_secret_names(spec.pod.env, spec.pod.env_from, spec.pod.volumes)
    return list(dict.fromkeys(names))


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
    return (
        policy_errors(
            policy,
            images=images,
            default_images=(defaults.server_image, defaults.router_image, defaults.endpoint_picker_image),
            service_account=spec.pod.service_account_name,
            secrets=model_secret_names(im),
        )
        + scheduling_errors(
            policy,
            priority_class=spec.scheduling.priority_class_name,
            tolerations=spec.scheduling.tolerations,
            node_selector=spec.scheduling.node_selector,
            affinity=spec.scheduling.affinity,
        )
        + credential_volume_errors(policy, spec.pod.volumes)
    )
