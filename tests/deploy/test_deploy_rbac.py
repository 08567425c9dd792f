"""Least privilege, measured: the real operator (`kubeinfer-operator run`, the chart's command, with
the chart's arguments: leader election on) runs against kmock through a full InferenceModel life
(create with routing, autoscaler switch, monitoring and routing off, drift, two nodes per replica and
back, a bad spec, delete); every
API request it makes is turned into an RBAC (group, resource, verb) and compared with the ClusterRole
and the leader election Role the chart renders. Every request must be allowed, and every granted
permission must have been used. Its liveness endpoint must answer on the path the chart's probe uses.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import kmock
import pytest
from deploy_helpers import (
    HelmInstall,
    MockApiServer,
    add_admission_policy_kinds,
    helm_install,
    helm_python,
    helm_skip_reason,
)
from kubeinfer_operator.k8s import USER_AGENT
from kubeinfer_operator.render_activator import render_activator_role
from kubeinfer_operator.spec import InferenceModel
from kubernetes.config import kube_config
from serving import free_port

pytestmark = [
    pytest.mark.skipif(helm_python() is None, reason=helm_skip_reason()),
    pytest.mark.slow,
]

NS = "models"
Perm = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

DISCOVERY_PREFIXES = ("/api", "/apis", "/version", "/openapi", "/healthz")


class ThreadedApi:
    """The mock API server on its own event loop, so that kopf (own thread, own loop) can call it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedApi:
        self.thread.start()
        self.api, self.server = self.call(self._start)
        self.url = str(self.server.url).rstrip("/")
        return self

    async def _start(self) -> tuple[MockApiServer, kmock.Server]:
        api = MockApiServer()
        await api.__aenter__()
        api.resources.load_bundled()
        extra = {
            "kubeinfer.dev/v1alpha1/inferencemodels": ("InferenceModel", {"status", "scale"}),
            "monitoring.coreos.com/v1/servicemonitors": ("ServiceMonitor", set()),
            "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", set()),
            "leaderworkerset.x-k8s.io/v1/leaderworkersets": ("LeaderWorkerSet", {"status", "scale"}),
        }
        add_admission_policy_kinds(api)
        for key, (kind, subresources) in extra.items():
            api.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources=subresources,
            )
        server = kmock.Server(api)
        await server.__aenter__()
        return api, server

    def call(self, fn: Callable[[], Any]) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(fn(), self.loop)
        return fut.result(timeout=30)

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            await self.server.__aexit__(None, None, None)
            await self.api.__aexit__(None, None, None)

        self.call(stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def http(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def objects(self) -> dict[tuple[str, str | None, str], dict[str, Any]]:
        async def snapshot() -> dict[tuple[str, str | None, str], dict[str, Any]]:
            return {
                (res.plural or "", ns, name): json.loads(json.dumps(obj.raw))
                for (res, ns, name), obj in self.api.objects.items()
                if not obj.deleted
            }

        out: dict[tuple[str, str | None, str], dict[str, Any]] = self.call(snapshot)
        return out

    def requests(self) -> list[Any]:
        async def snapshot() -> list[Any]:
            return list(self.api)

        out: list[Any] = self.call(snapshot)
        return out


def wait_for(what: str, check: Callable[[], bool], timeout: float = 90.0) -> None:
    # Generous: a passing wait returns when its condition holds; the operator reconciles in another
    # thread, which a loaded CI machine can hold back for more than 30 s.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def to_permission(req: Any) -> Iterator[Perm]:
    path = req.url.path
    if re.fullmatch(r"/api/v1/namespaces/[^/]+", path):
        # kmock's path parser reads this as a namespace without a resource: a read of the Namespace.
        assert req.method.value == "GET", f"unexpected {req.method} {path}"
        yield "", "namespaces", "get"
        return
    if req.resource is None or req.resource.plural is None:
        assert path.startswith(DISCOVERY_PREFIXES), f"unexpected non-resource request {req.method} {path}"
        return  # discovery: allowed to every authenticated user (system:discovery)
    group = req.resource.group or ""
    resource = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
    method = req.method.value
    if method == "GET":
        if req.params.get("watch") == "true":
            yield group, resource, "watch"
        else:
            yield group, resource, "get" if req.name else "list"
    elif method == "POST":
        yield group, resource, "create"
    elif method == "PATCH":
        yield group, resource, "patch"
        if "apply-patch" in req.headers.get("Content-Type", ""):
            # An apply may create the object; the API server then also checks `create`.
            yield group, resource, "create"
    elif method == "PUT":
        yield group, resource, "update"
    elif method == "DELETE":
        yield group, resource, "delete" if req.name else "deletecollection"
    else:
        raise AssertionError(f"unexpected method {method} {path}")


def granted(role: dict[str, Any]) -> set[Perm]:
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def model(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kubeinfer.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


def run_operator_life(tmp_path: Path, chart_args: list[str]) -> set[Perm]:
    from kubeinfer_operator.__main__ import _run, build_parser

    # The chart's own `kubeinfer-operator run` arguments; only the liveness address moves to a free port.
    liveness_port = free_port()
    args = [
        f"--liveness=http://127.0.0.1:{liveness_port}/healthz" if a.startswith("--liveness=") else a
        for a in chart_args
    ]

    with ThreadedApi() as api:
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "k", "cluster": {"server": api.url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u", "namespace": NS}}],
                    "current-context": "k",
                }
            )
        )
        env = {
            "KUBECONFIG": str(kubeconfig),
            "KUBEINFER_RETRY_BASE_SECONDS": "0.5",
            "KUBEINFER_RETRY_MAX_SECONDS": "1",
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        # The kubernetes client reads $KUBECONFIG once, at import; point its default at the mock.
        saved_default = kube_config.KUBE_CONFIG_DEFAULT_LOCATION
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(kubeconfig)
        try:
            stop = threading.Event()
            lost = threading.Event()
            outcome: list[Any] = []

            def target() -> None:
                try:
                    outcome.append(_run(build_parser().parse_args(args), stop_flag=stop, on_lost=lost.set))
                except BaseException as exc:
                    outcome.append(exc)

            operator = threading.Thread(target=target, name="operator", daemon=True)
            operator.start()
            try:
                plural = "/apis/kubeinfer.dev/v1alpha1/namespaces/models/inferencemodels"
                liveness = next(a for a in args if a.startswith("--liveness=")).removeprefix("--liveness=")
                wait_for("kopf's liveness endpoint", lambda: _http_ok(liveness))

                def deleted_by_operator() -> set[str]:
                    return {
                        r.resource.plural
                        for r in api.requests()
                        if r.method == "DELETE"
                        and r.resource is not None
                        and r.name in ("m", "m-router", "m-adapters", "m-lws")
                        and r.headers.get("User-Agent", "").startswith(USER_AGENT)
                    }

                def children() -> set[str]:
                    return {plural for plural, ns, name in api.objects() if ns == NS and name == "m"}

                scaling: dict[str, Any] = {
                    "minReplicas": 2,
                    "maxReplicas": 4,
                    "autoscaler": "HPA",
                    "metric": "QueueDepth",
                    "target": 4,
                }
                spec: dict[str, Any] = {
                    "model": {"uri": "hf://org/tiny"},
                    "scaling": scaling,
                    "routing": {"enabled": True},  # the router's ServiceAccount, Role and RoleBinding
                    "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}],  # the adapters' ConfigMap
                }
                api.http("POST", plural, model("m", spec))
                wait_for(
                    "HPA, PDB and ServiceMonitor",
                    lambda: (
                        {
                            "horizontalpodautoscalers",
                            "poddisruptionbudgets",
                            "servicemonitors",
                            "deployments",
                            "services",
                        }
                        <= children()
                    ),
                )
                # Switch to KEDA: the ScaledObject appears, the HPA is deleted.
                scaling["autoscaler"] = "KEDA"
                scaling["prometheusAddress"] = "http://prometheus:9090"
                api.http(
                    "PATCH",
                    f"{plural}/m",
                    {"spec": spec, "metadata": {"generation": 2}},
                    "application/merge-patch+json",
                )
                wait_for(
                    "KEDA switch",
                    lambda: "scaledobjects" in children() and "horizontalpodautoscalers" not in children(),
                )
                # One fixed replica, no monitoring, routing off, no adapters: ScaledObject, PDB and
                # ServiceMonitor go away, and so do the router's objects (its ServiceAccount, Role and
                # RoleBinding too) and the adapters' ConfigMap.
                spec2 = {
                    "model": spec["model"],
                    "scaling": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4, "autoscaler": "None"},
                    "monitoring": {"serviceMonitor": {"enabled": False}},
                    "routing": {"enabled": False},
                    "adapters": [],  # a merge patch: the list must be emptied explicitly
                }
                api.http(
                    "PATCH",
                    f"{plural}/m",
                    {"spec": spec2, "metadata": {"generation": 3}},
                    "application/merge-patch+json",
                )
                optional = {"servicemonitors", "scaledobjects", "poddisruptionbudgets"}
                optional |= {
                    "serviceaccounts",
                    "roles",
                    "rolebindings",
                    "deployments",
                    "services",
                    "configmaps",
                }
                try:
                    wait_for(
                        "optional children deleted by the operator", lambda: optional <= deleted_by_operator()
                    )
                except AssertionError as exc:
                    raise AssertionError(f"{exc}: never deleted {optional - deleted_by_operator()}") from None
                # Drift: a deleted Service comes back.
                api.http("DELETE", f"/api/v1/namespaces/{NS}/services/m")
                wait_for("Service restored", lambda: "services" in children())
                # Two nodes per replica: a LeaderWorkerSet replaces the Deployment; back to one node
                # deletes it again.
                multi = {
                    **spec2,
                    "engine": {"tensorParallelSize": 2},
                    "resources": {"gpu": {"count": 1}},
                    "parallelism": {"nodes": 2},
                }
                api.http(
                    "PATCH",
                    f"{plural}/m",
                    {"spec": multi, "metadata": {"generation": 4}},
                    "application/merge-patch+json",
                )
                wait_for(
                    "LeaderWorkerSet",
                    lambda: any(p == "leaderworkersets" and n == "m-lws" for p, _, n in api.objects()),
                )
                api.http(
                    "PATCH",
                    f"{plural}/m",
                    {
                        "spec": {"parallelism": {"nodes": 1}, "engine": {"tensorParallelSize": 1}},
                        "metadata": {"generation": 5},
                    },
                    "application/merge-patch+json",
                )
                wait_for("LeaderWorkerSet deleted", lambda: "leaderworkersets" in deleted_by_operator())
                # A shared model cache: the claim and the loader Job first, the Deployment once the
                # Job has succeeded (the test plays the Job controller); a new revision replaces the
                # Job; an adopted claim is read.
                cached = {
                    "model": {"uri": "hf://org/tiny", "revision": "v1"},
                    "cache": {"mode": "Shared", "size": "1Gi"},
                }
                api.http("POST", plural, model("c", cached))
                jobs_path = f"/apis/batch/v1/namespaces/{NS}/jobs"

                def loader_jobs() -> list[str]:
                    return [name for plural_, ns, name in api.objects() if plural_ == "jobs" and ns == NS]

                wait_for("the loader Job", lambda: len(loader_jobs()) == 1)
                (first_job,) = loader_jobs()
                done = {"status": {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}}
                api.http("PATCH", f"{jobs_path}/{first_job}/status", done, "application/merge-patch+json")
                wait_for("the cached model's Deployment", lambda: ("deployments", NS, "c") in api.objects())
                cached["model"]["revision"] = "v2"
                api.http(
                    "PATCH",
                    f"{plural}/c",
                    {"spec": cached, "metadata": {"generation": 2}},
                    "application/merge-patch+json",
                )
                wait_for("the next loader Job", lambda: loader_jobs() and first_job not in loader_jobs())
                adopted = {
                    "model": {"uri": "hf://org/tiny"},
                    "cache": {"mode": "Shared", "claimName": "team"},
                }
                api.http("POST", plural, model("d", adopted))
                wait_for(
                    "the adopted claim looked up",
                    lambda: any(
                        r.method == "GET"
                        and r.resource is not None
                        and r.resource.plural == "persistentvolumeclaims"
                        and r.name == "team"
                        for r in api.requests()
                    ),
                )
                # An undeployable spec: Degraded status, a warning event.
                api.http(
                    "POST",
                    plural,
                    model("bad", {"model": {"uri": "hf://org/tiny"}, "engine": {"extraArgs": ["--model=x"]}}),
                )
                wait_for(
                    "Degraded status of the bad spec",
                    lambda: any(
                        r.method == "PATCH" and r.name == "bad" and r.subresource == "status"
                        for r in api.requests()
                    ),
                )
                api.http("DELETE", f"{plural}/m")
                api.http("DELETE", f"{plural}/bad")
                api.http("DELETE", f"{plural}/c")
                api.http("DELETE", f"{plural}/d")
                time.sleep(1.0)
            finally:
                stop.set()
                operator.join(timeout=120)
            assert not operator.is_alive(), "the operator did not stop"
            assert outcome == [0], outcome
            assert not lost.is_set(), "leadership lost during the run"
            # It led, and released the Lease once stopped.
            lease = api.objects()[("leases", "kubeinfer-system", "ki-kubeinfer")]
            assert lease["spec"].get("holderIdentity") in (None, "")
        finally:
            kube_config.KUBE_CONFIG_DEFAULT_LOCATION = saved_default
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        used: set[Perm] = set()
        for req in api.requests():
            # The test's own requests (creating and editing InferenceModels) are not the operator's.
            if not req.headers.get("User-Agent", "").startswith("Python-urllib"):
                used |= set(to_permission(req))
    return used


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> HelmInstall:
    # Rendered and installed by Helm itself with the default values: cluster-wide, leader election on.
    inst = asyncio.run(helm_install({}, tmp_path_factory.mktemp("helm-rbac"), "kubeinfer-system", "ki"))
    assert inst.ok, inst.error
    return inst


@pytest.fixture(scope="module")
def clusterrole(chart: HelmInstall) -> dict[str, Any]:
    return chart.one("ClusterRole", "ki-kubeinfer")


@pytest.fixture(scope="module")
def lease_role(chart: HelmInstall) -> dict[str, Any]:
    return chart.one("Role", "ki-kubeinfer-leader-election", "kubeinfer-system")


@pytest.fixture(scope="module")
def operator_permissions(chart: HelmInstall, tmp_path_factory: pytest.TempPathFactory) -> set[Perm]:
    container = chart.one("Deployment", "ki-kubeinfer")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kubeinfer-operator"] and container["args"][0] == "run"
    assert "--leader-elect" in container["args"]
    return run_operator_life(tmp_path_factory.mktemp("rbac"), container["args"])


def test_every_request_of_the_operator_is_allowed(
    operator_permissions: set[Perm], clusterrole: dict[str, Any], lease_role: dict[str, Any]
) -> None:
    missing = operator_permissions - granted(clusterrole) - granted(lease_role)
    assert not missing, f"the chart's ClusterRole and leader election Role lack {sorted(missing)}"


def test_every_granted_permission_is_used(
    operator_permissions: set[Perm], clusterrole: dict[str, Any], lease_role: dict[str, Any]
) -> None:
    # RBAC lets the operator grant the router's Role (list/watch pods) and a scale-to-zero activator's
    # (its workload's scale subresource) only if it holds them itself.
    held_to_grant = {("", "pods", verb) for verb in ("get", "list", "watch")}
    multi_node = {
        "resources": {"gpu": {"count": 1}},
        "parallelism": {"nodes": 2},
        "engine": {"tensorParallelSize": 2},
    }
    for spec in ({}, multi_node):
        doc = {
            "apiVersion": "kubeinfer.dev/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"model": {"uri": "hf://o/m"}, "scaling": {"minReplicas": 0, "replicas": 1}, **spec},
        }
        held_to_grant |= granted(render_activator_role(InferenceModel.from_manifest(doc)))
    unused = granted(clusterrole) - operator_permissions - held_to_grant
    assert not unused, f"granted but never used: {sorted(unused)}"
    assert granted(lease_role) == {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    assert granted(lease_role) <= operator_permissions, "get, create and update of the Lease all happen"
