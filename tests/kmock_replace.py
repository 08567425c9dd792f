"""PUT (replace), and a patch's preconditions, with the API server's optimistic concurrency, for kmock's
emulator (which serves no PUT and applies any patch).

Shared by tests/operator/op_cluster.py and tests/deploy/deploy_helpers.py (tests/ is on sys.path).
What the API server does for an update (k8s.io/apiserver registry/rest.Update, BeforeUpdate):
- the object must exist (404 NotFound; Leases do not allow create-on-update);
- a `metadata.resourceVersion` in the body that is not the stored one is refused with 409 Conflict
  ("the object has been modified; please apply your changes to the latest version and try again");
- otherwise the body replaces the object whole, uid and creationTimestamp kept, with a new
  resourceVersion; watchers get MODIFIED. A body equal to the stored object writes nothing (the same
  resourceVersion, no event: v1.36.2).
What it does for a patch (`unwritten_patch`, seen on v1.36.2): a merge or apply patch whose
`metadata.resourceVersion` is not the stored one is the same 409 Conflict; a JSON patch whose `test` fails
or whose path does not exist (kopf guards finalizer changes with `test` on the resourceVersion) is
`422 Invalid` "the server rejected our request due to an error in our request" (kmock answered 500).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
from kmock import KubernetesEmulator, KubernetesError
from kmock._internal import dicts as kmock_dicts
from kmock._internal import rendering


def _method(request: rendering.Request) -> str:
    method = request.method
    return str(getattr(method, "value", method)).upper()


def is_replace(request: rendering.Request) -> bool:
    return _method(request) == "PUT" and request.resource is not None and request.name is not None


def _conflict(qualified: str, name: str) -> KubernetesError:
    return KubernetesError(
        status=409,
        reason="Conflict",
        message=(
            f'Operation cannot be fulfilled on {qualified} "{name}": the object has been '
            "modified; please apply your changes to the latest version and try again"
        ),
    )


def _qualified(request: rendering.Request) -> str:
    resource = request.resource
    assert resource is not None
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def _unchanged_by(request: rendering.Request, live: dict[str, Any]) -> dict[str, Any] | None:
    """`live` when `request` is a patch that changes nothing in it, else None. The API server writes
    nothing then: no new resourceVersion and no watch event (v1.36.2 answered a repeated patch 200 with
    the version it had); kmock would store a new version and send MODIFIED."""
    if _method(request) != "PATCH" or not isinstance(request.data, (dict, list)):
        return None
    try:
        merged = kmock_dicts.patch_dict(copy.deepcopy(live), request.data)
    except Exception:  # a bad JSON patch: kmock's answer
        return None
    return live if dict(merged) == live else None


def _patch_refusal(request: rendering.Request, live: dict[str, Any]) -> KubernetesError | None:
    """What the API server answers a PATCH of the stored object `live` instead of applying it, or None."""
    data = request.data
    if isinstance(data, list):  # a JSON patch
        try:
            jsonpatch.apply_patch(copy.deepcopy(live), data)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException):
            return KubernetesError(
                status=422,
                reason="Invalid",
                message="the server rejected our request due to an error in our request",
            )
        return None
    wanted = ((data or {}).get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
    if wanted and wanted != (live.get("metadata") or {}).get("resourceVersion"):
        return _conflict(_qualified(request), str(request.name))
    return None


def unwritten_patch(request: rendering.Request, live: dict[str, Any]) -> dict[str, Any] | None:
    """For a PATCH of the stored object `live`, what the API server does before it writes: raises its
    refusal (a stale resourceVersion, a failed JSON patch test), returns `live` when the patch changes
    nothing (nothing is written, no event), else None (the emulator applies it). None for other methods."""
    if _method(request) != "PATCH":
        return None
    refused = _patch_refusal(request, live)
    if refused is not None:
        raise refused
    return _unchanged_by(request, live)


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
            raise _conflict(qualified, request.name)
        meta["name"] = request.name
        if request.namespace:
            meta["namespace"] = request.namespace
        for kept in ("uid", "creationTimestamp", "resourceVersion"):
            if kept in live_meta:
                meta[kept] = live_meta[kept]
        if body == live:
            return aiohttp.web.json_response(live)  # nothing changes: nothing is written
        meta["resourceVersion"] = next_rv()
        objects[key].create(body)  # a new version in the object's history, replacing the old
        raw = objects[key].raw
        await emulator._buses[resource].put({"type": "MODIFIED", "object": raw})
    return aiohttp.web.json_response(raw)
