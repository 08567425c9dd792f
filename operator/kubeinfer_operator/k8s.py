"""The only module that talks to the Kubernetes API server (through the official kubernetes client).

Children are written with server-side apply under one field manager, so a reconcile is idempotent and
fields that other controllers own (an autoscaler's replica count, defaults) are left alone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.config.config_exception import ConfigException

from .common import FIELD_MANAGER
from .leader import LeaseConflictError
from .spec import API_VERSION, PLURAL

# The API server takes a request's field manager from the User-Agent (up to its first "/") when the
# request names none, and kubectl shows it; Events carry the component and the replica that posted them.
USER_AGENT = f"{FIELD_MANAGER}/1"
REPORTING_INSTANCE = os.environ.get("POD_NAME") or socket.gethostname()


@dataclass(frozen=True)
class KindInfo:
    api_version: str
    plural: str


KINDS: dict[str, KindInfo] = {
    "Deployment": KindInfo("apps/v1", "deployments"),
    "Service": KindInfo("v1", "services"),
    "PodDisruptionBudget": KindInfo("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": KindInfo("autoscaling/v2", "horizontalpodautoscalers"),
    "ServiceMonitor": KindInfo("monitoring.coreos.com/v1", "servicemonitors"),
    "ScaledObject": KindInfo("keda.sh/v1alpha1", "scaledobjects"),
    # spec.routing: the router's identity and its pod-listing permission (routing.py)
    "ServiceAccount": KindInfo("v1", "serviceaccounts"),
    "Role": KindInfo("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": KindInfo("rbac.authorization.k8s.io/v1", "rolebindings"),
    # cache.mode Shared: the model's cache claim and its loader Job (cache.py)
    "PersistentVolumeClaim": KindInfo("v1", "persistentvolumeclaims"),
    "Job": KindInfo("batch/v1", "jobs"),
    # spec.parallelism.nodes > 1 (lws.py); optional, like the two CRD kinds above
    "LeaderWorkerSet": KindInfo("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    # spec.routing.gateway (gateway.py)
    "InferencePool": KindInfo("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": KindInfo("gateway.networking.k8s.io/v1", "httproutes"),
    "InferenceObjective": KindInfo("inference.networking.x-k8s.io/v1alpha2", "inferenceobjectives"),
    "InferenceModel": KindInfo(API_VERSION, PLURAL),
    "Pod": KindInfo("v1", "pods"),
    # read to leave a terminating namespace alone (reconciler.py)
    "Namespace": KindInfo("v1", "namespaces"),
    # leader election between operator replicas (leader.py)
    "Lease": KindInfo("coordination.k8s.io/v1", "leases"),
    "Event": KindInfo("v1", "events"),
    # spec.adapters: the adapter list the server reads at start (adapters.py)
    "ConfigMap": KindInfo("v1", "configmaps"),
    # the per-model admin API key (credentials.py): created, never read
    "Secret": KindInfo("v1", "secrets"),
    # spec.network: the pods' and the router's NetworkPolicies (netpol.py)
    "NetworkPolicy": KindInfo("networking.k8s.io/v1", "networkpolicies"),
}


class ApiError(Exception):
    """A failed API call. `status` is the HTTP code, or None when no response came back."""

    def __init__(self, status: int | None, reason: str, message: str, action: str) -> None:
        super().__init__(f"{action}: {status or 'no response'} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.action = action

    @property
    def transient(self) -> bool:
        """Worth retrying: conflicts, throttling, server errors, timeouts, missing namespaces/CRDs
        (which appear later) and RBAC (which an admin may fix). Validation errors (400/422) are not."""
        return self.status not in (400, 422)

    @property
    def namespace_terminating(self) -> bool:
        """The API server's NamespaceLifecycle admission refused a create: the namespace is being
        deleted (403 "... unable to create new content in namespace x because it is being terminated")."""
        return self.status == 403 and "because it is being terminated" in self.message


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{name}"
    return base


def parse_version(info: dict[str, Any]) -> tuple[int, int] | None:
    """(major, minor) of a /version answer; minor may carry a vendor's '+' ("31+" on EKS and GKE)."""
    try:
        return int(str(info["major"]).rstrip("+")), int(str(info["minor"]).rstrip("+"))
    except (KeyError, ValueError):
        return None


class KubeClient:
    def __init__(
        self, api_client: kclient.ApiClient, request_timeout: float = 30.0, discovery_ttl: float = 60.0
    ) -> None:
        self._api = api_client
        self._timeout = request_timeout
        self._discovery: dict[str, tuple[float, bool]] = {}
        self._version: tuple[float, tuple[int, int] | None] | None = None
        # An optional CRD installed later is seen within this many seconds.
        self.discovery_ttl = discovery_ttl

    @classmethod
    def from_environment(
        cls, request_timeout: float = 30.0, discovery_ttl: float = 60.0, retries: bool | None = None
    ) -> KubeClient:
        """In-cluster service account if present, else KUBECONFIG (the same order kopf logs in with).
        retries=False: no transparent urllib3 retries (leader election: a retried PUT whose first try
        went through would come back 409, and each attempt must fit the renew deadline)."""
        cfg = kclient.Configuration()
        try:
            kconfig.load_incluster_config(client_configuration=cfg)
        except ConfigException:
            kconfig.load_kube_config(client_configuration=cfg)
        if retries is not None:
            cfg.retries = retries
        api = kclient.ApiClient(cfg)
        # The API server names a write's field manager after the User-Agent when the request gives none
        # (the client's default is `OpenAPI-Generator/...`): ours, so that every write is one manager's.
        api.user_agent = USER_AGENT
        return cls(api, request_timeout=request_timeout, discovery_ttl=discovery_ttl)

    def close(self) -> None:
        self._api.close()

    def _request(
        self,
        method: str,
        path: str,
        action: str,
        body: Any = None,
        content_type: str | None = None,
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        query = list(query or [])
        if method in ("POST", "PUT", "PATCH") and not any(k == "fieldManager" for k, _ in query):
            # Every write under one field manager (status, scale, leases and Events included).
            query.append(("fieldManager", FIELD_MANAGER))
        m, url, hdrs, payload, _ = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self._api.call_api(
                m, url, header_params=hdrs, body=payload, _request_timeout=self._timeout
            )
            data = resp.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(None, type(exc).__name__, str(exc), action) from exc
        if resp.status == 404 and method in ("GET", "DELETE"):
            return None
        if not 200 <= resp.status < 300:
            reason, message = resp.reason or "", ""
            try:
                st = json.loads(data)
                reason = st.get("reason") or reason
                message = st.get("message") or ""
            except (ValueError, AttributeError):
                message = (data or b"")[:200].decode(errors="replace")
            raise ApiError(resp.status, reason, message, action)
        return json.loads(data) if data else {}

    def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        info = KINDS[obj["kind"]]
        meta = obj["metadata"]
        path = object_path(info.api_version, info.plural, meta["namespace"], meta["name"])
        out = self._request(
            "PATCH",
            path,
            action=f"applying {obj['kind']} {meta['namespace']}/{meta['name']}",
            body=obj,
            content_type="application/apply-patch+yaml",
            # force: this operator is the single owner of what it renders; a hand edit is drift.
            query=[("fieldManager", field_manager), ("force", "true")],
        )
        assert out is not None
        return out

    def create(self, obj: dict[str, Any]) -> bool:
        """Create an object (POST); False when one of that name exists already (409 AlreadyExists).
        For kinds the operator may create but not read or patch (Secrets)."""
        info = KINDS[obj["kind"]]
        meta = obj["metadata"]
        try:
            self._request(
                "POST",
                object_path(info.api_version, info.plural, meta["namespace"]),
                action=f"creating {obj['kind']} {meta['namespace']}/{meta['name']}",
                body=obj,
                content_type="application/json",
                query=[("fieldManager", FIELD_MANAGER)],
            )
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        info = KINDS[kind]
        return self._request(
            "GET",
            object_path(info.api_version, info.plural, namespace, name),
            action=f"reading {kind} {namespace}/{name}",
        )

    def namespace_terminating(self, namespace: str) -> bool:
        """Whether the Namespace is being deleted (deletionTimestamp set, phase Terminating). False when
        it cannot be read: a reconcile then finds out from the API server's 403 on its first create."""
        try:
            ns = self._request(
                "GET", object_path("v1", "namespaces", None, namespace), f"reading Namespace {namespace}"
            )
        except ApiError:
            return False
        if ns is None:
            return False
        return bool((ns.get("metadata") or {}).get("deletionTimestamp")) or (
            (ns.get("status") or {}).get("phase") == "Terminating"
        )

    def set_scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any] | None:
        """Merge-patch the scale subresource (autoscaling/v1 Scale) of a Deployment or LeaderWorkerSet;
        None when the object is gone. The activator's only write (RBAC: `<plural>/scale` patch)."""
        info = KINDS[kind]
        return self._request(
            "PATCH",
            object_path(info.api_version, info.plural, namespace, name) + "/scale",
            action=f"scaling {kind} {namespace}/{name} to {replicas}",
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` matching a label selector (`k=v,k2=v2`)."""
        info = KINDS[kind]
        out = self._request(
            "GET",
            object_path(info.api_version, info.plural, namespace),
            action=f"listing {info.plural} in {namespace}",
            query=[("labelSelector", label_selector)],
        )
        return list((out or {}).get("items") or [])

    def delete(self, kind: str, namespace: str, name: str, owner_uid: str | None = None) -> bool:
        """Delete a child if it exists and (when owner_uid is given) is controlled by that owner."""
        if owner_uid is not None:
            live = self.get(kind, namespace, name)
            if live is None:
                return False
            owners = (live.get("metadata") or {}).get("ownerReferences") or []
            if not any(o.get("uid") == owner_uid for o in owners):
                return False  # not ours: never delete what someone else created under that name
        info = KINDS[kind]
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if owner_uid is not None:
            uid = ((live or {}).get("metadata") or {}).get("uid")
            if uid:
                body["preconditions"] = {"uid": uid}
        out = self._request(
            "DELETE",
            object_path(info.api_version, info.plural, namespace, name),
            action=f"deleting {kind} {namespace}/{name}",
            body=body,
            content_type="application/json",
        )
        return out is not None

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        path = object_path(API_VERSION, PLURAL, namespace, name) + "/status"
        self._request(
            "PATCH",
            path,
            action=f"writing status of InferenceModel {namespace}/{name}",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    # --- leader election (leader.LeaseStore): plain create and replace, so that the API server's
    # resourceVersion check turns a race between two candidates into a 409 for one of them.

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get("Lease", namespace, name)

    def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]:
        return self._lease_write("POST", object_path("coordination.k8s.io/v1", "leases", namespace), lease)

    def replace_lease(self, namespace: str, name: str, lease: dict[str, Any]) -> dict[str, Any]:
        path = object_path("coordination.k8s.io/v1", "leases", namespace, name)
        return self._lease_write("PUT", path, lease)

    def _lease_write(self, method: str, path: str, lease: dict[str, Any]) -> dict[str, Any]:
        meta = lease["metadata"]
        action = f"{'creating' if method == 'POST' else 'updating'} Lease {meta['namespace']}/{meta['name']}"
        try:
            out = self._request(method, path, action=action, body=lease, content_type="application/json")
        except ApiError as exc:
            if exc.status == 409:
                raise LeaseConflictError(str(exc)) from exc
            raise
        assert out is not None
        return out

    def create_event(
        self, involved: dict[str, Any], type_: str, reason: str, message: str, component: str
    ) -> None:
        """Post a core/v1 Event about `involved` ({apiVersion, kind, name, namespace, uid}); for
        threads outside kopf's handlers, where kopf.event() has no queue to post to."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        namespace = involved["namespace"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": involved,
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": REPORTING_INSTANCE,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self._request(
            "POST",
            object_path("v1", "events", namespace),
            action=f"posting an Event on {involved['kind']} {namespace}/{involved['name']}",
            body=body,
            content_type="application/json",
        )

    def server_version(self) -> tuple[int, int] | None:
        """The API server's (major, minor) from /version (None when it does not say), cached like
        discovery: a control-plane upgrade is seen within discovery_ttl."""
        cached = self._version
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.discovery_ttl:
            return cached[1]
        found = self._request("GET", "/version", action="reading the server version")
        version = parse_version(found or {})
        self._version = (now, version)
        return version

    def forget_discovery(self) -> None:
        """Drop cached discovery answers (a CRD was added or removed)."""
        self._discovery.clear()

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (e.g. an optional CRD), cached for discovery_ttl."""
        key = f"{api_version}/{plural}"
        cached = self._discovery.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.discovery_ttl:
            return cached[1]
        path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        found = self._request("GET", path, action=f"discovering {api_version}")
        served = found is not None and any(r.get("name") == plural for r in found.get("resources") or [])
        self._discovery[key] = (now, served)
        return served
