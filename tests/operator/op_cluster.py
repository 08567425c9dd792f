"""A kmock-based Kubernetes API for the operator's integration tests.

kmock's KubernetesEmulator keeps objects in memory and serves list/watch/get/create/patch/delete. The
subclass here adds the few API-server behaviours the operator relies on: server-side apply creates a
missing object, objects get a uid/generation/resourceVersion, owner references are garbage-collected,
and faults (HTTP errors, dropped watch streams) can be injected *before* any state changes.

It runs on its own event loop in a thread, so tests stay synchronous and the operator (kopf's
KopfRunner, another thread) talks to it over real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import kopf
from kmock import KubernetesEmulator, KubernetesError, ResourceInfo
from kmock._internal import enums, rendering
from kmock_builtin import (
    builtin_schemas,
    invalid_causes,
    patch_type_error,
    refusal,
    type_error,
    update_causes,
)
from kmock_lifecycle import Namespaces, refuse_create, serve_namespace
from kmock_params import request_error
from kmock_pruning import prune_resource
from kmock_replace import is_replace, serve_replace, unwritten_patch
from kmock_subresources import drop_status_on_create, field_validation, status_patch, status_replace
from kmock_watch import ResumableWatches
from kopf.testing import KopfRunner
from op_apichecks import api_errors, canonicalize_resources, update_errors
from op_gatewaychecks import GATEWAY_KINDS, gateway_invalid, gateway_undeclared
from op_testlib import crd_schema

NAMESPACE = "default"

BASE_RESOURCES: dict[str, ResourceInfo] = {
    "kubeinfer.dev/v1alpha1/inferencemodels": ResourceInfo(
        kind="InferenceModel", namespaced=True, subresources={"status", "scale"}
    ),
    "apps/v1/deployments": ResourceInfo(kind="Deployment", namespaced=True, subresources={"status", "scale"}),
    "v1/services": ResourceInfo(kind="Service", namespaced=True, subresources={"status"}),
    "policy/v1/poddisruptionbudgets": ResourceInfo(kind="PodDisruptionBudget", namespaced=True),
    "autoscaling/v2/horizontalpodautoscalers": ResourceInfo(kind="HorizontalPodAutoscaler", namespaced=True),
    "v1/events": ResourceInfo(kind="Event", namespaced=True),
    "v1/pods": ResourceInfo(kind="Pod", namespaced=True, subresources={"status"}),
    # leader election between operator replicas (kubeinfer_operator/leader.py)
    "coordination.k8s.io/v1/leases": ResourceInfo(kind="Lease", namespaced=True),
    # cache.mode Shared: the cache claim and its loader Job
    "v1/persistentvolumeclaims": ResourceInfo(
        kind="PersistentVolumeClaim", namespaced=True, subresources={"status"}
    ),
    "batch/v1/jobs": ResourceInfo(kind="Job", namespaced=True, subresources={"status"}),
    "v1/configmaps": ResourceInfo(kind="ConfigMap", namespaced=True),
    # the per-model admin API key (kubeinfer_operator/credentials.py)
    "v1/secrets": ResourceInfo(kind="Secret", namespaced=True),
    "networking.k8s.io/v1/networkpolicies": ResourceInfo(kind="NetworkPolicy", namespaced=True),
    # kopf waits for these two in discovery before it starts; scanning them is disabled in the tests
    # (kmock cannot route the cluster-wide /api/v1/namespaces list).
    "v1/namespaces": ResourceInfo(kind="Namespace", namespaced=False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False
    ),
}
MONITORING = {
    "monitoring.coreos.com/v1/servicemonitors": ResourceInfo(kind="ServiceMonitor", namespaced=True)
}
KEDA = {"keda.sh/v1alpha1/scaledobjects": ResourceInfo(kind="ScaledObject", namespaced=True)}
# The LWS controller's CRD (spec.parallelism.nodes > 1); scale as its CRD declares it.
LWS = {
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, subresources={"status", "scale"}
    )
}
# The Gateway API Inference Extension's and the Gateway API's CRDs (spec.routing.gateway).
INFERENCE_EXTENSION = {
    "inference.networking.k8s.io/v1/inferencepools": ResourceInfo(kind="InferencePool", namespaced=True),
    "gateway.networking.k8s.io/v1/httproutes": ResourceInfo(kind="HTTPRoute", namespaced=True),
    "inference.networking.x-k8s.io/v1alpha2/inferenceobjectives": ResourceInfo(
        kind="InferenceObjective", namespaced=True
    ),
}
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}

PATHS = {
    "InferenceModel": "/apis/kubeinfer.dev/v1alpha1/namespaces/{ns}/inferencemodels",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "ServiceMonitor": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects",
    "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Event": "/api/v1/namespaces/{ns}/events",
    "Lease": "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
    # spec.routing's router identity and permission
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    # spec.routing.gateway
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "HTTPRoute": "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes",
    "InferenceObjective": "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives",
}
PLURAL_KIND = {p.rsplit("/", 1)[-1]: k for k, p in PATHS.items()}


@dataclass
class Fault:
    """Answer `count` matching requests with an HTTP error instead of serving them."""

    status: int
    count: int
    method: str | None = None  # GET, PATCH, ...
    plural: str | None = None
    subresource: str | None = None
    predicate: Callable[[rendering.Request], bool] | None = None
    fired: int = 0


@dataclass
class WatchHold:
    """Hold the next `count` watch requests of `plural` until `release` is set (at most `seconds`) before
    serving them, as a busy API server or a slow reconnect would: whatever is written meanwhile falls
    between two streams. `holding` is set while one is held."""

    plural: str
    seconds: float
    count: int = 1
    fired: int = 0
    holding: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class WatchDrop:
    """Close `count` matching watch streams after `after` seconds, as a flaky network or an API server
    restart would."""

    count: int
    after: float
    plural: str | None = None
    fired: int = 0


def _method(request: rendering.Request) -> str:
    method = request.method
    return str(getattr(method, "value", method)).upper()


def field_manager(request: rendering.Request) -> str:
    """The field manager the API server records for a write: the fieldManager parameter, else the
    User-Agent up to its first "/" (apiserver's handlers.fieldmanager prefixFromUserAgent)."""
    given = request.params.get("fieldManager")
    if given:
        return str(given)
    agent = str(request.headers.get("User-Agent") or "unknown")
    return agent.split("/", 1)[0]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ApiServer(ResumableWatches, KubernetesEmulator):
    faults: list[Fault] = attrs.field(factory=list)
    watch_drops: list[WatchDrop] = attrs.field(factory=list)
    watch_holds: list[WatchHold] = attrs.field(factory=list)
    # Answer every watch with this error, as a real API server answers a watch it cannot parse (issue 29 F3).
    refused_watch: KubernetesError | None = None
    _rv: Any = attrs.field(factory=lambda: itertools.count(1000))
    namespace_store: Namespaces = attrs.field(factory=Namespaces)
    # Structural schemas by plural: what every write of those kinds is pruned to (kmock_pruning.py).
    # The built-in kinds' come from kube-apiserver's /openapi/v3 (kmock_builtin.py).
    schemas: dict[str, dict[str, Any]] = attrs.field(
        factory=lambda: {"inferencemodels": crd_schema(), **builtin_schemas()}
    )
    # (field manager, plural, subresource, path) of every field pruned so far
    pruned: list[tuple[str, str, str, str]] = attrs.field(factory=list)

    def _match_fault(self, request: rendering.Request) -> Fault | None:
        if request.resource is None:
            return None
        for fault in self.faults:
            if fault.fired >= fault.count:
                continue
            if fault.method is not None and _method(request) != fault.method:
                continue
            if fault.plural is not None and request.resource.plural != fault.plural:
                continue
            if fault.subresource is not None and request.subresource != fault.subresource:
                continue
            if fault.predicate is not None and not fault.predicate(request):
                continue
            if request.action == enums.action.WATCH:
                continue  # watches are cut with WatchDrop, not failed
            fault.fired += 1
            return fault
        return None

    def _stamp(self, obj: dict[str, Any], namespace: str | None) -> None:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if namespace and not meta.get("namespace"):
            meta["namespace"] = namespace
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["generation"] = 1
        meta["resourceVersion"] = str(next(self._rv))

    async def _serve_list(self, request: rendering.Request) -> Any:
        # kmock lists with resourceVersion "...", which kopf echoes in its watch; the API server lists
        # with an integer one and refuses anything else in a watch (kmock_params.options_error).
        payload: Any = await super()._serve_list(request)
        payload["metadata"]["resourceVersion"] = str(next(self._rv))
        return payload

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        refused = request_error(request)  # e.g. timeoutSeconds=60.0: the API server's 400
        if refused is None and request.action == enums.action.WATCH:
            refused = self.refused_watch
        if refused is not None:
            raise refused
        fault = self._match_fault(request)
        if fault is not None:
            raise KubernetesError(
                status=fault.status, reason="InjectedFault", message=f"injected {fault.status}"
            )
        warnings: list[str] = []
        schema = self.schemas.get(request.resource.plural or "") if request.resource is not None else None
        # POST, PATCH and PUT (kmock gives PUT no action); not a DELETE's DeleteOptions body
        writes = request.action in (enums.action.CREATE, enums.action.UPDATE) or is_replace(request)
        if (
            writes
            and isinstance(request.data, dict)
            and request.subresource is None
            and (request.action == enums.action.CREATE or is_replace(request))
        ):
            # The JSON decoder's type errors come before the strict decoder's unknown fields.
            wrong_type = type_error(request.resource.plural or "", request.data)  # type: ignore[union-attr]
            if wrong_type is not None:
                raise wrong_type
        if schema is not None and writes and isinstance(request.data, dict):
            # Every write, on the main resource or /status, whole or a merge patch (JSON patches, lists,
            # are kopf's finalizer tests on metadata only); an apply of an undeclared field is refused.
            undeclared = prune_resource(request.data, schema)
            manager = field_manager(request)
            plural, sub = request.resource.plural or "", request.subresource or ""  # type: ignore[union-attr]
            self.pruned += [(manager, plural, sub, path) for path in undeclared]
            if undeclared and "apply-patch" in (request.headers.get("Content-Type") or ""):
                meta = request.data.get("metadata") or {}
                raise KubernetesError(
                    status=500,
                    message=f"failed to create typed patch object ({meta.get('namespace', '')}/{request.name}; "
                    f"{request.data.get('apiVersion')}, Kind={request.data.get('kind')}): "
                    f"{undeclared[0]}: field not declared in schema",
                )
            warnings = field_validation(
                request.params.get("fieldValidation"),
                undeclared,
                kind=str(request.data.get("kind") or PLURAL_KIND.get(plural, "")),
                version=str(request.data.get("apiVersion") or "").rsplit("/", 1)[-1],
                patch=request.action == enums.action.UPDATE and not is_replace(request),
                body=request.data,
            )
        response = await self._serve(request)
        if request.action == enums.action.CREATE and response.status == 200:
            response.set_status(201)  # kmock answers a create with 200; the API server with 201 Created
        for warning in warnings:
            response.headers.add("Warning", warning)
        return response

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if (
            request.resource is not None
            and request.subresource == "status"
            and isinstance(request.data, dict)
        ):
            # The API server writes nothing but status through /status (a changed spec is ignored).
            # kmock's Request is frozen: its body is rewritten in place.
            written: dict[str, Any] | None = None
            if is_replace(request) and request.name is not None:
                target = (request.resource, request.namespace, request.name)
                if target in self._objects and not self._objects[target].deleted:
                    written = status_replace(request.data, self._objects[target].raw)
            elif request.action == enums.action.UPDATE:
                written = status_patch(request.data)
            if written is not None:
                request.data.clear()
                request.data.update(written)
        if is_replace(request):
            return await serve_replace(self, request, lambda: str(next(self._rv)))
        namespace = serve_namespace(self.namespace_store, request)
        if namespace is not None:
            return namespace

        deleted_uid: str | None = None
        created: dict[str, Any] | None = None
        key = None
        if request.resource is not None and isinstance(request.data, dict):
            data: dict[str, Any] = request.data
            whole = request.action == enums.action.CREATE or (
                request.action == enums.action.UPDATE
                and "apply-patch" in (request.headers.get("Content-Type") or "")
            )
            if whole and request.subresource is None:
                if request.action == enums.action.CREATE:
                    self._refuse_invalid(request, data)
                # The refusals kmock does not make itself (names, labels, strategy): a real 422.
                kind = PLURAL_KIND.get(request.resource.plural or "", "")
                if kind in GATEWAY_KINDS:
                    # Their CRDs' own rules (a pool's selector checks label values only), and ObjectMeta's.
                    errors = api_errors({"kind": kind, "metadata": data.get("metadata")})
                    errors += gateway_invalid({"kind": kind, **data})
                else:
                    errors = api_errors({"kind": kind, **data})
                if errors:
                    raise KubernetesError(status=422, reason="Invalid", message="; ".join(errors))
                undeclared = gateway_undeclared({"kind": kind, **data}) if kind in GATEWAY_KINDS else []
                if undeclared and request.action == enums.action.UPDATE:
                    # A server-side apply of a field the CRD does not declare (a create prunes it).
                    raise KubernetesError(
                        status=500,
                        message="failed to create typed patch object: "
                        + (
                            undeclared[0]
                            if ": " in undeclared[0]
                            else f"{undeclared[0]}: field not declared in schema"
                        ),
                    )
                if request.resource.plural == "deployments":
                    canonicalize_resources(data)
            if request.action == enums.action.CREATE:
                refuse_create(
                    self.namespace_store,
                    request.resource,
                    request.namespace,
                    (data.get("metadata") or {}).get("name"),
                )
                drop_status_on_create(PLURAL_KIND.get(request.resource.plural or "", ""), data)
                self._allocate_cluster_ip(request.resource.plural or "", data)
                self._own_replicas(request, data, None)
                self._stamp(data, request.namespace)
            elif request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                async with self._lock:
                    live = self._objects[key] if key in self._objects else None  # noqa: SIM401
                    alive = live is not None and not live.deleted
                    self._own_replicas(request, data, live.raw if alive and live is not None else None)
                    if live is None or live.deleted:
                        if "apply-patch" in (request.headers.get("Content-Type") or ""):
                            # Server-side apply of a missing object creates it.
                            self._refuse_invalid(request, data)
                            refuse_create(
                                self.namespace_store, request.resource, request.namespace, request.name
                            )
                            drop_status_on_create(PLURAL_KIND.get(request.resource.plural or "", ""), data)
                            self._stamp(data, request.namespace)
                            self._objects[key] = data
                            raw = self._objects[key].raw
                            await self._buses[request.resource].put({"type": "ADDED", "object": raw})
                            created = raw
                    else:
                        old = live.raw
                        content_type = request.headers.get("Content-Type") or ""
                        if request.subresource is None and "merge-patch" in content_type:
                            # The patched object is decoded again: a type error is a 422 on `patch`.
                            patched = kmock._internal.dicts.patch_dict(old, data)
                            wrong_type = patch_type_error(request.resource.plural or "", dict(patched))
                            if wrong_type is not None:
                                raise wrong_type
                        merged_spec = (
                            kmock._internal.dicts.patch_dict(old.get("spec") or {}, data["spec"])
                            if request.subresource is None and "spec" in data
                            else None
                        )
                        if merged_spec is not None and isinstance(data["spec"], dict):
                            # The spec validated again, and immutable fields (a Job's template, a claim's spec): the real 422.
                            causes = update_causes(
                                request.resource.plural or "",
                                old,
                                dict(merged_spec),
                                revalidate="apply-patch" not in content_type,
                            )
                            if causes:
                                raise refusal(request.resource.plural or "", old, request.name, causes)
                            refused = update_errors(old.get("kind", ""), old, dict(merged_spec))
                            if refused:
                                raise KubernetesError(
                                    status=422, reason="Invalid", message="; ".join(refused)
                                )
                        # The write's new resourceVersion comes with its MODIFIED event (kmock_watch).
                        if merged_spec is not None and merged_spec != (old.get("spec") or {}):
                            meta = data.setdefault("metadata", {})
                            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
                        # The API server ignores status on the main resource and everything but status
                        # on /status; the emulator merges whatever comes, so enforce that here.
                        if (
                            request.subresource is None
                            and live.get("status") is not None
                            and "status" in data
                        ):
                            old_kind = old.get("kind", "")
                            if old_kind in ("InferenceModel", "Deployment", "LeaderWorkerSet"):
                                data.pop("status")
                if created is not None:
                    await self._collect_orphan(request.resource, key)
                    return aiohttp.web.json_response(created, status=201)

        # Any write may delete: a DELETE, or a patch (JSON or merge) that removes the last finalizer.
        if (
            request.resource is not None
            and request.action in (enums.action.DELETE, enums.action.UPDATE)
            and request.name is not None
        ):
            key = (request.resource, request.namespace, request.name)
        if key is not None and key in self._objects and not self._objects[key].deleted:
            deleted_uid = (self._objects[key].raw.get("metadata") or {}).get("uid")
            unchanged = unwritten_patch(request, self._objects[key].raw)
            if unchanged is not None:
                return aiohttp.web.json_response(unchanged)
        response = await super()._handle(request)
        if key is not None and deleted_uid is not None and self._objects[key].deleted:
            await self._collect_garbage(deleted_uid)
        return response

    def _allocate_cluster_ip(self, plural: str, data: dict[str, Any]) -> None:
        """A Service gets a cluster IP at create, as the API server allocates one from
        --service-cluster-ip-range (10.96.0.0/16 on the probed server); clusterIPs mirrors it."""
        spec = data.get("spec")
        if plural != "services" or not isinstance(spec, dict) or spec.get("type") == "ExternalName":
            return
        if not spec.get("clusterIP"):
            serial = next(self._rv)
            spec["clusterIP"] = f"10.96.{serial // 250 % 250}.{serial % 250 + 1}"
        spec.setdefault("clusterIPs", [spec["clusterIP"]])

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        # The API server's 500s (a failed typed patch) carry no reason; kmock would name its class.
        response = await super()._render_error(exc)
        if (
            isinstance(exc, KubernetesError)
            and exc.reason is None
            and isinstance(response, aiohttp.web.Response)
        ):
            body = json.loads(response.body)  # type: ignore[arg-type]
            body.pop("reason", None)
            return aiohttp.web.json_response(body, status=response.status)
        return response

    def _refuse_invalid(self, request: rendering.Request, data: dict[str, Any]) -> None:
        """A create of a built-in kind that its validation refuses: the real 422 with its causes."""
        plural = request.resource.plural or "" if request.resource is not None else ""
        causes = invalid_causes(plural, data)
        if causes:
            name = str((data.get("metadata") or {}).get("name") or request.name or "")
            raise refusal(plural, data, name, causes)

    def _own_replicas(
        self, request: rendering.Request, data: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        """Server-side apply's field ownership, for a Deployment's spec.replicas only (kmock merges
        patches and tracks no owners): a manager's apply that omits a field it owned gives the field
        up, and a field nobody owns any more is reset to its default (1). An update (merge patch,
        /scale) takes the field over. managedFields shows the owners, as the API server does."""
        if request.resource is None or request.resource.plural not in ("deployments", "leaderworkersets"):
            return
        if request.subresource == "status":
            return
        apply = "apply-patch" in (request.headers.get("Content-Type") or "")
        operation = "Apply" if apply else "Update"
        manager = field_manager(request)
        owners = {
            str(e.get("manager")): str(e.get("operation"))
            for e in ((old or {}).get("metadata") or {}).get("managedFields") or []
            if "f:replicas" in ((e.get("fieldsV1") or {}).get("f:spec") or {})
        }
        spec = data.get("spec") if isinstance(data.get("spec"), dict) else None
        live_value = ((old or {}).get("spec") or {}).get("replicas")
        if spec is not None and "replicas" in spec:
            if old is not None and spec["replicas"] == live_value:
                owners[manager] = operation
            else:
                owners = {manager: operation}
        elif apply and request.subresource is None:
            owners.pop(manager, None)
            if not owners:
                data.setdefault("spec", {})["replicas"] = 1
        elif old is None:
            data.setdefault("spec", {})["replicas"] = 1
        data.setdefault("metadata", {})["managedFields"] = [
            {
                "manager": m,
                "operation": op,
                "apiVersion": str(data.get("apiVersion") or (old or {}).get("apiVersion") or "apps/v1"),
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:replicas": {}}},
            }
            for m, op in sorted(owners.items())
        ]

    async def _collect_orphan(self, resource: Any, key: Any) -> None:
        """The garbage collector also removes a new dependent whose owner no longer exists (an apply
        that raced with the owner's deletion)."""
        async with self._lock:
            obj = self._objects[key]
            owners = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            if not owners:
                return
            live_uids = {
                (o.raw.get("metadata") or {}).get("uid") for o in self._objects.values() if not o.deleted
            }
            if all(ref.get("uid") in live_uids for ref in owners):
                return
            raw = obj.raw
            obj.delete()
            await self._buses[resource].put({"type": "DELETED", "object": raw})

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion: dependents of a deleted owner go too (recursively)."""
        async with self._lock:
            doomed = []
            for (resource, _, _), obj in list(self._objects.items()):
                if obj.deleted:
                    continue
                owners = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
                if any(o.get("uid") == owner_uid for o in owners):
                    doomed.append((resource, obj))
            uids = []
            for resource, obj in doomed:
                raw = obj.raw
                obj.delete()
                uids.append((raw.get("metadata") or {}).get("uid"))
                await self._buses[resource].put({"type": "DELETED", "object": raw})
        for uid in uids:
            if uid:
                await self._collect_garbage(uid)

    def _resource_versions(self) -> itertools.count[int]:
        return self._rv  # type: ignore[no-any-return]

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        drop = None
        for candidate in self.watch_drops:
            plural_ok = candidate.plural is None or (
                request.resource is not None and request.resource.plural == candidate.plural
            )
            if candidate.fired < candidate.count and plural_ok:
                candidate.fired += 1
                drop = candidate
                break
        for hold in self.watch_holds:
            if (
                hold.fired < hold.count
                and request.resource is not None
                and request.resource.plural == hold.plural
            ):
                hold.fired += 1
                hold.holding.set()
                try:
                    deadline = asyncio.get_running_loop().time() + hold.seconds
                    while not hold.release.is_set() and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.02)
                finally:
                    hold.holding.clear()
                break
        stream: Any = super()._serve_watch(request)
        # Like the API server, end the stream after ?timeoutSeconds= (kmock itself ignores it).
        limit: float | None = int(request.params.get("timeoutSeconds") or 0) or None
        if drop is not None:
            limit = drop.after if limit is None else min(limit, drop.after)
        if limit is None:
            async for item in stream:
                yield item
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        try:
            while (remaining := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(anext(stream), timeout=remaining)
                except (TimeoutError, StopAsyncIteration):
                    break
                yield item
        finally:
            await stream.aclose()


@dataclass
class MockCluster:
    """The emulator on a private loop and thread, plus a tiny synchronous client for the tests."""

    resources: dict[str, ResourceInfo]
    server: ApiServer = field(init=False)
    url: str = field(init=False, default="")
    _loop: asyncio.AbstractEventLoop = field(init=False)
    _thread: threading.Thread = field(init=False)
    _stop: asyncio.Event = field(init=False)

    def start(self) -> MockCluster:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def main() -> None:
            self._stop = asyncio.Event()
            self.server = ApiServer()
            for key, info in self.resources.items():
                info.verbs = set(VERBS)
                self.server.resources[key] = info
            async with self.server, kmock.Server(self.server) as srv:
                self.url = str(srv.url).rstrip("/")
                ready.set()
                await self._stop.wait()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(main())

        self._thread = threading.Thread(target=run, name="kmock", daemon=True)
        self._thread.start()
        if not ready.wait(60):  # generous: a loaded machine starts the thread's event loop late
            raise RuntimeError("kmock did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def add_resources(self, resources: dict[str, ResourceInfo]) -> None:
        for key, info in resources.items():
            info.verbs = set(VERBS)
            self.server.resources[key] = info

    def install_crds(self, resources: dict[str, ResourceInfo]) -> None:
        """Serve the kinds, then create their CustomResourceDefinitions: the watch event a real API
        server sends when someone installs a CRD (add_resources alone sends none)."""
        self.add_resources(resources)
        for key, info in resources.items():
            group, version, plural = key.split("/")
            crd = {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{group}"},
                "spec": {
                    "group": group,
                    "names": {"kind": info.kind, "plural": plural},
                    "scope": "Namespaced" if info.namespaced else "Cluster",
                    "versions": [{"name": version, "served": True, "storage": True}],
                },
            }
            self.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}],
                    "current-context": "kmock",
                }
            )
        )
        return path

    # --- a minimal kubectl

    def answer(
        self,
        method: str,
        path: str,
        body: Any,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, list[str], dict[str, Any]]:
        """(HTTP status, Warning headers, JSON body) of one request, errors included: what the tests of
        the mock's answers compare with a real API server's."""
        query = "?" + urllib.parse.urlencode(params) if params else ""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path + query, data=data, method=method)
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.headers.get_all("Warning") or [], json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get_all("Warning") or [], json.loads(exc.read())

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return json.loads(text) if text else None

    def create(self, kind: str, obj: dict[str, Any], ns: str = NAMESPACE) -> dict[str, Any]:
        out = self.request("POST", PATHS[kind].format(ns=ns), obj)
        assert out is not None
        return dict(out)

    def get(self, kind: str, name: str, ns: str = NAMESPACE) -> dict[str, Any] | None:
        return self.request("GET", f"{PATHS[kind].format(ns=ns)}/{name}")  # type: ignore[no-any-return]

    def patch(
        self,
        kind: str,
        name: str,
        patch: dict[str, Any],
        ns: str = NAMESPACE,
        subresource: str = "",
        field_manager: str = "",
    ) -> Any:
        path = f"{PATHS[kind].format(ns=ns)}/{name}" + (f"/{subresource}" if subresource else "")
        if field_manager:
            path += f"?fieldManager={field_manager}"
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def apply(self, kind: str, obj: dict[str, Any], manager: str, ns: str = NAMESPACE) -> Any:
        """Server-side apply (forced) under a field manager, as `kubectl apply --server-side` does."""
        path = f"{PATHS[kind].format(ns=ns)}/{obj['metadata']['name']}?fieldManager={manager}&force=true"
        return self.request("PATCH", path, obj, "application/apply-patch+yaml")

    def delete(self, kind: str, name: str, ns: str = NAMESPACE) -> Any:
        return self.request("DELETE", f"{PATHS[kind].format(ns=ns)}/{name}")

    def replace(self, kind: str, obj: dict[str, Any], ns: str = NAMESPACE) -> Any:
        """PUT: replace the whole object (409 if its metadata.resourceVersion is not the stored one)."""
        return self.request("PUT", f"{PATHS[kind].format(ns=ns)}/{obj['metadata']['name']}", obj)

    def live(self, kind: str) -> list[dict[str, Any]]:
        """Every existing object of a kind, straight from the emulator's store."""
        plural = PATHS[kind].rsplit("/", 1)[-1]
        return [
            obj.raw
            for (res, _, _), obj in list(self.server.objects.items())
            if res.plural == plural and not obj.deleted
        ]

    def history(self, kind: str, name: str, ns: str = NAMESPACE) -> list[dict[str, Any]]:
        """Every stored version of an object, oldest first (deletions skipped)."""
        plural = PATHS[kind].rsplit("/", 1)[-1]
        out = []
        for (res, namespace, obj_name), obj in list(self.server.objects.items()):
            if res.plural == plural and namespace == ns and obj_name == name:
                out += [dict(v.raw) for v in obj.history if v is not None]
        return out

    def count_requests(self, method: str, plural: str) -> int:
        return sum(
            1
            for r in list(self.server)
            if _method(r) == method and r.resource is not None and r.resource.plural == plural
        )


def wait_for(predicate: Callable[[], Any], timeout: float = 90.0, what: str = "condition") -> Any:
    """Polls `predicate` until it returns a truthy value (returned) or `timeout` seconds pass
    (AssertionError). The default is generous: a passing wait returns as soon as the condition holds, and a
    kopf operator reconciling in another thread on a loaded CI machine took longer than 15 s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def wait_quiet(cluster: MockCluster, quiet: float = 3.0, timeout: float = 90.0) -> None:
    """Waits until the API server has seen no write (POST, PUT, PATCH, DELETE) for `quiet` seconds in a
    row: the reconciles under way have finished (a fixed short sleep let a reconcile that a loaded
    machine ran late write after the test's snapshot). AssertionError after `timeout` seconds."""

    def writes() -> int:
        return sum(1 for r in list(cluster.server) if _method(r) in ("POST", "PUT", "PATCH", "DELETE"))

    deadline = time.monotonic() + timeout
    count, since = writes(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"the operator kept writing for {timeout} s"
        time.sleep(0.1)
        if (now := writes()) != count:
            count, since = now, time.monotonic()


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def operator_settings(server_timeout: int = 5) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.watching.connect_timeout = 5
    # Each watch stream ends after 5 s (the emulator honours timeoutSeconds); the re-listing that
    # follows is the operator's periodic resync.
    settings.watching.server_timeout = server_timeout
    settings.watching.client_timeout = server_timeout + 25
    settings.watching.reconnect_backoff = 0.05
    settings.queueing.exit_timeout = 1.0
    settings.queueing.idle_timeout = 1.0
    # The watched namespace is given exactly and the CRDs are fixed per test: no need to scan.
    settings.scanning.disabled = True
    return settings


@contextmanager
def run_operator(server_timeout: int = 5) -> Iterator[KopfRunner]:
    """server_timeout: how long each watch stream lasts; its re-listing resyncs every model (a test of
    what brings a change in without the resync sets it long)."""
    args = ["run", "--standalone", "-n", "default", "-m", "kubeinfer_operator", "--verbose"]
    settings = operator_settings(server_timeout)
    with KopfRunner(args, settings=settings, timeout=120) as runner:  # stop: a loaded machine
        yield runner
