"""The per-model management credential: the admin API key the operator's adapter sync sends to a
model's pods (server/api/admin.py says what it opens), kept in a Secret the operator creates.

The token is derived, never stored by the operator: HMAC-SHA256 of the model's namespace, name and
uid under the installation's management key (the chart's Secret, in the operator's environment as
KUBEINFER_MANAGEMENT_KEY). So the operator needs to *create* Secrets only and can read none: the
kubelet reads the Secret into the pods (env `KUBEINFER_ADMIN_API_KEY` from a secretKeyRef). RBAC
cannot restrict `create` by name (the object does not exist yet), so the operator may create any
Secret in the namespaces it watches, but read, change or delete none.

The Secret's name carries a digest of the management key and the model's uid: a new management
key (or a model recreated under the same name) gives a new name, hence a new Secret and a rolling
update that hands the pods the new token; an older Secret goes with its model (ownerReference).
A Secret of that name made by someone else is used as it is (the create answers 409): only who can
create Secrets in the namespace can do that, and the adapter sync then reports 401 from the pods.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any, Protocol

from .adapters import runtime_updates
from .defaults import ClusterDefaults
from .spec import InferenceModel

ADMIN_KEY_ENV = "KUBEINFER_ADMIN_API_KEY"  # the server's variable (server/cli.py --admin-api-key)
SECRET_KEY = "admin-api-key"
MANAGED_BY = "kubeinfer-operator"

# Without KUBEINFER_MANAGEMENT_KEY (an operator run outside the chart) one key per process: the pods'
# Secrets then change, and the pods roll, when the operator restarts.
_PROCESS_KEY = secrets.token_urlsafe(32)


def wants_admin_key(im: InferenceModel) -> bool:
    """Only a model whose pods the operator manages at run time (adapters) gets a management key."""
    return runtime_updates(im)


def _key(defaults: ClusterDefaults | None) -> bytes:
    key = defaults.management_key if defaults is not None else None
    return (key or _PROCESS_KEY).encode()


def admin_token(im: InferenceModel, defaults: ClusterDefaults | None = None) -> str:
    """The model's admin API key: 64 hex characters."""
    # a model read from the API server has a uid; a rendering without one (tests) uses ""
    message = f"{im.namespace}/{im.name}/{im.uid or ''}".encode()
    return hmac.new(_key(defaults), message, hashlib.sha256).hexdigest()


def admin_secret_name(im: InferenceModel, defaults: ClusterDefaults | None = None) -> str:
    """`<child name>-admin-<10 hex>` (a DNS-1123 subdomain: the child name is a 63-character label)."""
    digest = hmac.new(_key(defaults), f"name/{im.uid or ''}".encode(), hashlib.sha256).hexdigest()[:10]
    return f"{im.base_child_name}-admin-{digest}"


def render_admin_secret(
    im: InferenceModel, metadata: dict[str, Any], defaults: ClusterDefaults | None = None
) -> dict[str, Any]:
    """The Secret (immutable: nobody edits it in place) the pods read their admin key from;
    `metadata` = the model's child metadata (labels, ownerReferences)."""
    token = admin_token(im, defaults).encode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {**metadata, "name": admin_secret_name(im, defaults)},
        "type": "Opaque",
        "immutable": True,
        "data": {SECRET_KEY: base64.b64encode(token).decode()},
    }


def admin_env(im: InferenceModel, defaults: ClusterDefaults | None = None) -> list[dict[str, Any]]:
    """The server container's env var with the admin key (none when the model gets no key)."""
    if not wants_admin_key(im):
        return []
    ref = {"name": admin_secret_name(im, defaults), "key": SECRET_KEY}
    return [{"name": ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}]


class SecretCreator(Protocol):
    def create(self, obj: dict[str, Any]) -> bool: ...


def ensure_admin_secret(
    kube: SecretCreator,
    im: InferenceModel,
    metadata: dict[str, Any],
    defaults: ClusterDefaults | None = None,
) -> bool:
    """Create the model's admin-key Secret if the model gets one; True when this call created it.
    Runs before the workload is applied: its pods cannot start without the Secret."""
    if not wants_admin_key(im):
        return False
    return kube.create(render_admin_secret(im, metadata, defaults))
