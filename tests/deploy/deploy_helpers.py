"""Shared facts and helpers of the deployment tests (chart, dashboards, alerts, Dockerfiles).

Not a test module: the test_deploy_* files import it (tests/ directories are not packages, so pytest
puts this directory on sys.path).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import promql_parser
import yaml
from kmock._internal import enums as kmock_enums  # the emulator's action enum; no public alias
from kmock_crd import crd_refusal
from kmock_params import request_error
from kmock_replace import is_replace, serve_replace, unwritten_patch
from kmock_watch import ResumableWatches

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeinfer"
CHART_DASHBOARDS = CHART / "dashboards"
TOP_DASHBOARDS = REPO / "dashboards"
RULES_FILE = CHART / "rules" / "kubeinfer-alerts.yaml"
HELM_VENV = REPO / ".venv-helm"
HELM_DRIVER = Path(__file__).resolve().parent / "deploy_helm_driver.py"

# What the server exports (docs: shared/docs/metrics-and-quant-formats.md, label model_name), by type.
SERVER_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "tgi_queue_size",
    "tgi_batch_current_size",
)
SERVER_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "kubeinfer_http_requests_total",
)
# TGI's request counters, exported untyped and without the _total suffix, as TGI names them.
SERVER_TGI_COUNTERS = ("tgi_request_count", "tgi_request_success", "tgi_request_failure")
SERVER_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)

# vLLM's router (spec.routing, the chart's gateway): the series the dashboard reads, checked against the
# real router's /metrics in tests/router/test_router_e2e.py.
ROUTER_SERIES = frozenset(
    {
        "vllm_router_requests_total",
        "vllm_router_processed_requests_total",
        "vllm_router_prefix_routing_decisions_total",
        "vllm_router_worker_health",
        "vllm_router_retries_total",
    }
)


def activator_series_names() -> frozenset[str]:
    """Series the scale-to-zero activator exports, read from its own exposition (every family
    touched once so that labelled children and histogram buckets appear)."""
    from kubeinfer_operator.activator.metrics import ActivatorMetrics

    metrics = ActivatorMetrics("m")
    metrics.set_state(1, 1, True, 1)
    metrics.observe_wake(1.0)
    metrics.refused("held_limit")
    metrics.scaled("up")
    text = metrics.exposition().decode()
    return frozenset(
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    )


# Series that are not ours but that the dashboards and alerts read on purpose: kube-state-metrics'
# Deployment replicas (a server cannot know how many of its replicas are ready) and its Deployment
# labels (to keep only the Deployments the kubeinfer operator manages).
KSM_ALLOWED = frozenset(
    {
        "kube_deployment_status_replicas_ready",
        "kube_deployment_spec_replicas",
        "kube_deployment_labels",
    }
)


def documented_series_names() -> frozenset[str]:
    """Series names the documented server metrics produce in the Prometheus text format."""
    names = set(SERVER_GAUGES) | set(SERVER_COUNTERS) | set(SERVER_TGI_COUNTERS)
    for hist in SERVER_HISTOGRAMS:
        names |= {f"{hist}_bucket", f"{hist}_sum", f"{hist}_count"}
    return frozenset(names)


# Grafana's own variables, replaced the way Grafana does before the query reaches Prometheus.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "${namespace}": ".*",
    "$namespace": ".*",
    "${model_name}": ".*",
    "$model_name": ".*",
}


def substitute_grafana_vars(expr: str, values: dict[str, str] | None = None) -> str:
    subst = dict(GRAFANA_SUBSTITUTIONS)
    subst.update(values or {})
    # Longest keys first: $__rate_interval before $__interval.
    for key in sorted(subst, key=len, reverse=True):
        expr = expr.replace(key, subst[key])
    if "$" in re.sub(r"\{\{[^}]*\}\}", "", expr):
        raise ValueError(f"unsubstituted Grafana variable in {expr!r}")
    return expr


@dataclass(frozen=True)
class DashboardQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str  # as written in the dashboard, Grafana variables included


def load_dashboards(folder: Path = CHART_DASHBOARDS) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_queries(folder: Path = CHART_DASHBOARDS) -> list[DashboardQuery]:
    out = []
    for name, dash in load_dashboards(folder).items():
        for panel in iter_panels(dash["panels"]):
            for target in panel.get("targets", []):
                out.append(DashboardQuery(name, panel["title"], target["refId"], target["expr"]))
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")


def variable_selectors(folder: Path = CHART_DASHBOARDS) -> list[tuple[str, str]]:
    """(variable name, series selector) of every label_values() template variable."""
    out = []
    for dash in load_dashboards(folder).values():
        for var in dash["templating"]["list"]:
            if var.get("type") != "query":
                continue
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = _LABEL_VALUES.match(query.strip())
            if match is None:
                raise ValueError(f"variable {var['name']}: unsupported query {query!r}")
            out.append((var["name"], match["selector"]))
    return out


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    for_: str | None
    labels: dict[str, str]
    annotations: dict[str, str]


def load_alert_rules(path: Path = RULES_FILE) -> list[AlertRule]:
    doc = yaml.safe_load(path.read_text())
    return [
        AlertRule(r["alert"], r["expr"], r.get("for"), r.get("labels", {}), r.get("annotations", {}))
        for group in doc["groups"]
        for r in group["rules"]
        if "alert" in r
    ]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads; raises if promql-parser rejects it."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def vector_selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


_COMPARISONS = {">", "<", ">=", "<=", "==", "!="}


def strip_threshold(expr: str) -> str:
    """The alert's measured quantity: `X > 0.95` gives `X`, so a test can check that X has data.

    An alert expression returns series only while it fires; its left side returns them whenever the
    metrics exist, which is what a scrape test can assert on a healthy, lightly loaded server.
    """
    node = promql_parser.parse(expr)
    if (
        isinstance(node, promql_parser.BinaryExpr)
        and str(node.op) in _COMPARISONS
        and isinstance(node.rhs, promql_parser.NumberLiteral)
        and not (node.modifier is not None and node.modifier.return_bool)
    ):
        return str(node.lhs)
    raise ValueError(f"alert expression is not `<quantity> <comparison> <number>`: {expr!r}")


# ---- the Helm side: helm-sdkpy in its own Python >= 3.12 venv (scripts/setup-helm.sh) ----


def helm_python() -> Path | None:
    python = HELM_VENV / "bin" / "python"
    if not python.exists():
        return None
    ok = subprocess.run([str(python), "-c", "import helm_sdkpy"], capture_output=True, check=False)
    return python if ok.returncode == 0 else None


def helm_skip_reason() -> str:
    has_312 = any(shutil.which(c) for c in ("python3.12", "python3.13", "python3.14")) or bool(
        list(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python3"))
    )
    if not has_312:
        return "helm-sdkpy needs Python >= 3.12 and none is installed on this machine"
    return f"{HELM_VENV} with helm-sdkpy is missing: run scripts/setup-helm.sh"


def run_helm_driver(request: dict[str, Any], timeout: float = 180) -> dict[str, Any]:
    """Run one helm-sdkpy action in the helm venv; returns {"ok": bool, "result"|"error": ...}."""
    python = helm_python()
    if python is None:
        raise RuntimeError(helm_skip_reason())
    env = {**os.environ, "HELM_DRIVER": "memory", "HOME": str(Path(request.get("home", "/tmp")))}
    proc = subprocess.run(
        [str(python), str(HELM_DRIVER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"helm driver crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def hadolint_binary() -> str | None:
    for candidate in (
        shutil.which("hadolint"),
        str(Path(sys.executable).parent / "hadolint"),
        str(HELM_VENV / "bin" / "hadolint"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


# ---- the Kubernetes API mock (kmock) ----


class MockApiServer(ResumableWatches, kmock.KubernetesEmulator):
    """kmock plus the API-server behaviours Helm and the operator rely on."""

    _list_rv = itertools.count(1)  # shared by every instance: any increasing integer will do

    def _resource_versions(self) -> itertools.count[int]:
        return self._list_rv  # lists and events on one scale: a watch resumes from either

    async def _serve_server_version(self, request: Any) -> Any:
        # kmock reports 1.26; the chart needs 1.30 (kubeVersion), the oldest release we support.
        doc = dict(await super()._serve_server_version(request))
        doc.update({"major": "1", "minor": "30", "gitVersion": "v1.30.0"})
        return doc

    async def _serve_list(self, request: Any) -> Any:
        # kmock lists with resourceVersion "...", which kopf echoes in its watch; the API server lists
        # with an integer one and refuses anything else in a watch (kmock_params.options_error).
        payload = await super()._serve_list(request)
        payload["metadata"]["resourceVersion"] = str(next(self._list_rv))
        return payload

    async def _serve_version(self, request: Any) -> Any:
        doc = await super()._serve_version(request)
        if isinstance(doc, dict) and str(doc.get("groupVersion", "")).startswith("/"):
            doc["groupVersion"] = doc["groupVersion"][1:]
        return doc

    async def _handle(self, request: Any) -> Any:
        refused = request_error(request)  # e.g. timeoutSeconds=60.0: the API server's 400
        writes_crd = (
            request.resource is not None
            and request.subresource is None
            and request.resource.plural == "customresourcedefinitions"
            and request.action in (kmock_enums.action.CREATE, kmock_enums.action.UPDATE)
        )
        if refused is None and writes_crd:
            refused = crd_refusal(request.data)  # defaults against rules, rule costs: the real 422
        if refused is not None:
            raise refused
        # PUT (the operator's Lease updates): a replace with the API server's resourceVersion check.
        if is_replace(request):
            self._replaces = getattr(self, "_replaces", 0) + 1
            return await serve_replace(self, request, lambda: f"put-{self._replaces}")
        # Server-side apply creates a missing object (the API server then also checks `create`).
        if (
            request.action == kmock_enums.action.UPDATE
            and request.subresource is None
            and "apply-patch" in request.headers.get("Content-Type", "")
            and request.resource is not None
        ):
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self.objects or self.objects[key].deleted:
                    body = json.loads(json.dumps(request.data))
                    body.setdefault("metadata", {})["namespace"] = request.namespace
                    body["metadata"].setdefault("uid", f"uid-{request.name}-{len(self.objects)}")
                    if key in self.objects:
                        self.objects[key].create(body)
                    else:
                        self.objects[key] = body
                    event = {"type": "ADDED", "object": self.objects[key].raw}
                    await self._buses[request.resource].put(event)
                    return aiohttp.web.json_response(self.objects[key].raw, status=201)
            # The emulator's own update path then applies the body and answers with the object.
        if request.action == kmock_enums.action.UPDATE and request.resource is not None and request.name:
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                # A no-op patch (apply included) writes nothing and, as on a real API server, emits no
                # event (kmock would emit MODIFIED for every patch and start a reconcile storm).
                unchanged = unwritten_patch(request, self.objects[key].raw)
                if unchanged is not None:
                    return aiohttp.web.json_response(unchanged)
        return await super()._handle(request)


@dataclass(frozen=True)
class HelmInstall:
    ok: bool
    error: str
    release: dict[str, Any]
    objects: list[dict[str, Any]]  # as the API server received them

    def find(self, kind: str, name: str | None = None, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            o
            for o in self.objects
            if o["kind"] == kind
            and (name is None or o["metadata"]["name"] == name)
            and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]

    def one(self, kind: str, name: str | None = None, namespace: str | None = None) -> dict[str, Any]:
        found = self.find(kind, name, namespace)
        assert len(found) == 1, f"{kind}/{name} in {namespace}: {len(found)} objects"
        return found[0]


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{{name: kmock, cluster: {{server: "{url}"}}}}]
users: [{{name: test, user: {{token: test}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: test, namespace: {ns}}}}}]
current-context: kmock
"""


def add_admission_policy_kinds(api: Any) -> None:
    """ValidatingAdmissionPolicy and its binding (Kubernetes >= 1.30; the chart's secret-policy.yaml),
    which kmock's bundled discovery lacks."""
    for plural, kind in (
        ("validatingadmissionpolicies", "ValidatingAdmissionPolicy"),
        ("validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding"),
    ):
        api.resources[f"admissionregistration.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=False,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )


async def helm_install(values: dict[str, Any], tmp: Path, namespace: str, release: str) -> HelmInstall:
    async with MockApiServer() as api, kmock.Server(api) as server:
        api.resources.load_bundled()  # the built-in kinds of a real cluster's discovery
        add_admission_policy_kinds(api)
        for plural, kind in (("servicemonitors", "ServiceMonitor"), ("prometheusrules", "PrometheusRule")):
            api.resources[f"monitoring.coreos.com/v1/{plural}"] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
        kubeconfig = tmp / "kubeconfig.yaml"
        kubeconfig.write_text(KUBECONFIG.format(url=str(server.url).rstrip("/"), ns=namespace))
        request = {
            "action": "install",
            "chart": str(CHART),
            "kubeconfig": str(kubeconfig),
            "namespace": namespace,
            "release": release,
            "values": values,
            "home": str(tmp),
        }
        # The helm call blocks; run it off the loop that serves the mock API.
        answer = await asyncio.to_thread(run_helm_driver, request)
        objects = [json.loads(json.dumps(obj.raw)) for obj in api.objects.values() if not obj.deleted]
    return HelmInstall(
        ok=answer["ok"], error=answer.get("error", ""), release=answer.get("result") or {}, objects=objects
    )
