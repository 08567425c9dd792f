"""What every renderer of a model's children shares: names of the server container and its paths,
the labels and owner reference every child carries, a child's (kind, name), the restricted security
context, PromQL string literals. Pure; it imports
nothing from the other renderers (render.py, deployment.py, cache.py, lws.py, routing.py, adapters.py
all build on it), so they form no import cycle."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .spec import API_VERSION, KIND, InferenceModel

Manifest = dict[str, Any]

FIELD_MANAGER = "kubeinfer-operator"
CONTAINER_NAME = "server"
SERVER_PORT = 8080
CACHE_DIR = "/var/cache/kubeinfer"
TMP_DIR = "/tmp"
# The server process runs as this uid/gid; fsGroup makes mounted volumes writable for it.
RUN_AS_USER = 65532
STARTUP_PROBE_PERIOD_SECONDS = 10

# On the pod template: the InferenceModel's own name (which need not be a valid label value), so a pod
# event leads back to its model.
MODEL_ANNOTATION = "kubeinfer.dev/inference-model"


@dataclass(frozen=True)
class ChildRef:
    """One child by kind and name (in the model's namespace)."""

    kind: str
    name: str


def selector_labels(im: InferenceModel) -> dict[str, str]:
    # The derived child name: the InferenceModel's name may be 253 characters long, a label value 63.
    return {"app.kubernetes.io/name": "kubeinfer-server", "app.kubernetes.io/instance": im.child_name}


# On the canary's children and pods only (canary.py): the stable ones keep the labels they had, so
# adding a canary rolls nothing.
VARIANT_LABEL = "kubeinfer.dev/variant"


def labels(im: InferenceModel) -> dict[str, str]:
    out = {
        **selector_labels(im),
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": "kubeinfer",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
    }
    if im.variant == "canary":
        out[VARIANT_LABEL] = "canary"
    return out


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


def child_metadata(im: InferenceModel, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": im.child_name,
        "namespace": im.namespace,
        "labels": {**(extra_labels or {}), **labels(im)},
    }
    if im.uid is not None:
        meta["ownerReferences"] = [owner_reference(im)]
    return meta


def api_service_account(meta: dict[str, Any]) -> Manifest:
    """The ServiceAccount of a component that calls the API (router, activator, endpoint picker)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta,
        "automountServiceAccountToken": True,
    }


def role(meta: dict[str, Any], rules: list[dict[str, Any]]) -> Manifest:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules}


def own_role_binding(meta: dict[str, Any]) -> Manifest:
    """Binds the Role of `meta`'s name to the ServiceAccount of the same name, in its namespace."""
    name = meta["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta["namespace"]}],
    }


def endpoint_url(im: InferenceModel) -> str:
    return f"http://{im.child_name}.{im.namespace}.svc:{SERVER_PORT}"


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal (Go escaping), so a served name with quotes stays data."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def startup_failure_threshold(startup_timeout_seconds: int) -> int:
    return max(1, math.ceil(startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS))


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


def desired_replicas(im: InferenceModel) -> int:
    """Replicas the operator sets on the Deployment (meaningless while an autoscaler owns the count)."""
    return 0 if im.spec.suspend else im.spec.scaling.replicas


def service_account_name(im: InferenceModel) -> str:
    """What the model's pods (server, cache loader) run as: pod.serviceAccountName when the
    administrator allowed one, else the model's own ServiceAccount (render_service_account), never
    the namespace's `default`, to which others may have bound roles (issue 45 item 5)."""
    return im.spec.pod.service_account_name or im.base_child_name


def render_service_account(im: InferenceModel) -> dict[str, Any] | None:
    """The model's own ServiceAccount, with no API token (the server never calls the API server);
    None when pod.serviceAccountName names another."""
    if im.spec.pod.service_account_name is not None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(im),
        "automountServiceAccountToken": False,
    }
