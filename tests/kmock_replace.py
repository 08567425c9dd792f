"""PUT (replace) with the API server's optimistic concurrency, for kmock's emulator (which serves no PUT).

Shared by tests/operator/op_cluster.py and tests/deploy/deploy_helpers.py (tests/ is on sys.path).
What the API server does for an update (k8s.io/apiserver registry/rest.Update, BeforeUpdate):
- the object must exist (404 NotFound; Leases do not allow create-on-update);
- a `metadata.resourceVersion` in the body that is not the stored one is refused with 409 Conflict
  ("the object has been modified; please apply your changes to the latest version and try again");
- otherwise the body replaces the object whole, uid and creationTimestamp kept, with a new
  resourceVersion; watchers get MODIFIED.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp.web
from kmock import KubernetesEmulator, KubernetesError
from kmock._internal import rendering


def _method(request: rendering.Request) -> str:
    method = request.method
    return str(getattr(method, "value", method)).upper()


def is_replace(request: rendering.Request) -> bool:
    return _method(request) == "PUT" and request.resource is not None and request.name is not None


async def serve_replace(
    emulator: KubernetesEmulator, request: rendering.Request, next_rv: Callable[[], str]
) -> aiohttp.web.StreamResponse:
    """Serve one PUT on a named object (call only when is_replace(request))."""
    resource = request.resource
    assert resource is not None and request.name is not None
    qualified = f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)
    body = json.loads(json.dumps(request.data or {}))
    key = (resource, request.namespace, request.name)
    async with emulator._lock:
        objects = emulator._objects
        if key not in objects or objects[key].deleted:
            raise KubernetesError(
                status=404, reason="NotFound", message=f'{qualified} "{request.name}" not found'
            )
        live = objects[key].raw
        meta = body.setdefault("metadata", {})
        live_meta = live.get("metadata") or {}
        if meta.get("name", request.name) != request.name:
            raise KubernetesError(
                status=400,
                reason="BadRequest",
                message=f"the name of the object ({meta.get('name')}) does not match the name on the URL",
            )
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv and wanted_rv != live_meta.get("resourceVersion"):
            raise KubernetesError(
                status=409,
                reason="Conflict",
                message=(
                    f'Operation cannot be fulfilled on {qualified} "{request.name}": the object has been '
                    "modified; please apply your changes to the latest version and try again"
                ),
            )
        meta["name"] = request.name
        if request.namespace:
            meta["namespace"] = request.namespace
        for kept in ("uid", "creationTimestamp"):
            if kept in live_meta:
                meta[kept] = live_meta[kept]
        meta["resourceVersion"] = next_rv()
        objects[key].create(body)  # a new version in the object's history, replacing the old
        raw = objects[key].raw
        await emulator._buses[resource].put({"type": "MODIFIED", "object": raw})
    return aiohttp.web.json_response(raw)
