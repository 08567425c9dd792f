"""The API server's NamespaceLifecycle admission, for kmock: nothing new is created in a namespace that
is being terminated.

What a real kube-apiserver (v1.36.2, plugin/pkg/admission/namespace/lifecycle) answers while the namespace
controller empties a deleted namespace, seen on a real server during issue 29's check: any *create* (a
POST, or a server-side apply of an object that does not exist) in a namespace whose phase is Terminating is

    403 Forbidden: deployments.apps "x" is forbidden: unable to create new content in namespace ns because
    it is being terminated

with a cause of type NamespaceTerminating. Updates, patches and deletes of existing objects are admitted
(the namespace controller itself deletes them), as are reads.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
from kmock import KubernetesError

# kmock's path parser reads /api/v1/namespaces/<name> as a namespace without a resource, so the
# Namespace objects live here and GET /api/v1/namespaces/<name> is answered from them.
_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces/([a-z0-9]([-a-z0-9]*[a-z0-9])?)")


@dataclass
class Namespaces:
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    readable: bool = True  # False: reads answer 403, as without RBAC for namespaces

    def terminate(self, name: str) -> None:
        """What deleting a Namespace does first: deletionTimestamp and phase Terminating (the namespace
        controller then deletes its content)."""
        now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.objects[name] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "deletionTimestamp": now},
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Terminating"},
        }


def serve_namespace(store: Namespaces, request: Any) -> aiohttp.web.StreamResponse | None:
    """GET /api/v1/namespaces/<name>: the Namespace, 404, or 403 when reads are forbidden."""
    match = _NAMESPACE_PATH.fullmatch(str(request.url.path))
    if match is None or str(getattr(request.method, "value", request.method)).upper() != "GET":
        return None
    name = match.group(1)
    if not store.readable:
        raise KubernetesError(
            status=403,
            reason="Forbidden",
            message=f'namespaces "{name}" is forbidden: User "tester" cannot get resource "namespaces"',
        )
    if name not in store.objects:
        raise KubernetesError(status=404, reason="NotFound", message=f'namespaces "{name}" not found')
    return aiohttp.web.json_response(store.objects[name])


def terminating(store: Namespaces, namespace: str | None) -> bool:
    """Whether `namespace` exists and is being deleted."""
    if not namespace:
        return False
    ns = store.objects.get(namespace)
    if ns is None:
        return False
    return bool((ns.get("metadata") or {}).get("deletionTimestamp")) or (
        (ns.get("status") or {}).get("phase") == "Terminating"
    )


def refuse_create(store: Namespaces, resource: Any, namespace: str | None, name: str | None) -> None:
    """Raise the real 403 if a create of `resource`/`name` in `namespace` must be refused."""
    if not terminating(store, namespace):
        return
    group = getattr(resource, "group", "") or ""
    qualified = f"{resource.plural}.{group}" if group else str(resource.plural)
    raise KubernetesError(
        status=403,
        reason="Forbidden",
        message=(
            f'{qualified} "{name or ""}" is forbidden: unable to create new content in namespace '
            f"{namespace} because it is being terminated"
        ),
        details={
            "name": name or "",
            "group": group,
            "kind": resource.plural,
            "causes": [
                {
                    "reason": "NamespaceTerminating",
                    "message": f"namespace {namespace} is being terminated",
                    "field": "metadata.namespace",
                }
            ],
        },
    )
