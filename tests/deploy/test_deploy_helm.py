"""The chart through real Helm: `helm lint`, and `helm install` (helm-sdkpy, HELM_DRIVER=memory) into
kmock, the Kubernetes API mock server. What reaches the API server is what gets checked: every object
passes kubernetes-validate --strict, the operator's pod meets Pod Security "restricted", RBAC follows
the watch mode, and the dashboards and alerts arrive unchanged.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    CHART,
    CHART_DASHBOARDS,
    REPO,
    RULES_FILE,
    HelmInstall,
    helm_install,
    helm_python,
    helm_skip_reason,
    run_helm_driver,
)
from pod_security import RULES, Pod, containers

pytestmark = pytest.mark.skipif(helm_python() is None, reason=helm_skip_reason())

NAMESPACE = "kubeinfer-system"
RELEASE = "ki"
FULLNAME = "ki-kubeinfer"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate has.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced-ha": {
        "operator": {"watchNamespaces": ["team-a", "team-b"], "replicas": 2, "peering": {"enabled": True}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
        "grafanaDashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "kubeinfer"}},
        "prometheusAdapter": {"rules": {"enabled": True, "namespace": "monitoring"}},
    },
    "clusterwide-ha": {
        "operator": {"replicas": 2, "peering": {"enabled": True}, "verbose": True},
        "prometheusRule": {"enabled": True},
    },
    "replicas-without-peering": {"operator": {"replicas": 2}},
    "gateway": {"gateway": {"enabled": True, "serviceMonitor": True}},
}


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HelmInstall]:
    out = {}
    for name, values in SCENARIOS.items():
        tmp = tmp_path_factory.mktemp(name)
        out[name] = asyncio.run(helm_install(values, tmp, NAMESPACE, RELEASE))
    return out


def _ok(installs: dict[str, HelmInstall], name: str) -> HelmInstall:
    inst = installs[name]
    assert inst.ok, inst.error
    return inst


def test_helm_lint_has_no_warnings_or_errors() -> None:
    answer = run_helm_driver({"action": "lint", "chart": str(CHART)})
    assert answer["ok"], answer.get("error")
    messages = answer["result"]["Messages"] or []
    # Helm's severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error.
    assert [m for m in messages if m["Severity"] >= 2] == []
    assert answer["result"]["TotalChartsLinted"] == 1


def test_helm_lint_fails_a_broken_chart(tmp_path: Path) -> None:
    broken = tmp_path / "kubeinfer"
    subprocess.run(["cp", "-r", str(CHART), str(broken)], check=True)
    (broken / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata: {{ .Values.nope.nope }}\n")
    answer = run_helm_driver({"action": "lint", "chart": str(broken)})
    failed = not answer["ok"] or any(m["Severity"] >= 3 for m in answer["result"]["Messages"] or [])
    assert failed, answer


@pytest.mark.parametrize("scenario", ["defaults", "namespaced-ha", "clusterwide-ha", "gateway"])
def test_install_creates_only_valid_objects(installs: dict[str, HelmInstall], scenario: str) -> None:
    inst = _ok(installs, scenario)
    assert inst.release["info"]["status"] == "deployed"
    kinds = {o["kind"] for o in inst.objects}
    assert {"CustomResourceDefinition", "ServiceAccount", "Deployment", "ClusterRole"} <= kinds
    for obj in inst.objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # no Kubernetes schema; checked field by field below
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_chart_crds_are_installed_first_and_unchanged(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "defaults")
    shipped = [yaml.safe_load(p.read_text()) for p in sorted((CHART / "crds").glob("*.yaml"))]
    installed = inst.find("CustomResourceDefinition")
    assert sorted(c["metadata"]["name"] for c in installed) == sorted(c["metadata"]["name"] for c in shipped)
    for crd in shipped:
        got = next(c for c in installed if c["metadata"]["name"] == crd["metadata"]["name"])
        assert got["spec"] == crd["spec"]


def _pod(inst: HelmInstall) -> Pod:
    """The operator Deployment's pod spec, with the template's metadata (AppArmor annotations)."""
    template = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]
    return {**template["spec"], "metadata": template.get("metadata") or {}}


@pytest.mark.parametrize("scenario", ["defaults", "namespaced-ha"])
def test_operator_pod_meets_pod_security_restricted(installs: dict[str, HelmInstall], scenario: str) -> None:
    """Each control of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (v1.25+)."""
    pod = _pod(_ok(installs, scenario))
    for rule, check in RULES.items():
        assert check(pod) == [], rule
    # Beyond restricted: no sysctls at all, no container_engine_t SELinux type, nothing to write outside
    # the mounted emptyDir, and no root group.
    pod_sc = pod.get("securityContext", {})
    assert not pod_sc.get("sysctls")
    for c in containers(pod):
        sc = c.get("securityContext", {})
        assert sc.get("seLinuxOptions", {}).get("type") != "container_engine_t", c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
    assert pod_sc.get("runAsGroup") != 0


def test_operator_container_runs_kopf_with_liveness_and_resources(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "defaults")
    dep = inst.one("Deployment", FULLNAME, NAMESPACE)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kubeinfer/operator:0.1.0"
    args = container["args"]
    assert args[0] == "run" and "--module=kubeinfer_operator" in args
    assert "--all-namespaces" in args and "--standalone" in args
    liveness = next(a for a in args if a.startswith("--liveness="))
    port = next(p for p in container["ports"] if p["name"] == container["livenessProbe"]["httpGet"]["port"])
    assert liveness == f"--liveness=http://0.0.0.0:{port['containerPort']}/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    # kopf without peering must never run twice, not even during a rollout.
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert inst.one("ServiceAccount", sa, NAMESPACE)


def test_namespaced_mode_watches_only_listed_namespaces(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "namespaced-ha")
    args = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args and "--standalone" not in args
    assert "--peering=kubeinfer" in args


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_clusterwide_binds_one_clusterrole(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "defaults")
    assert inst.find("Role") == [] and inst.find("RoleBinding") == []
    rules = _rules(inst.one("ClusterRole", FULLNAME))
    assert ("kubeinfer.dev", "inferencemodels", "watch") in rules
    assert ("apps", "deployments", "patch") in rules
    assert not any(g == "kopf.dev" for g, _, _ in rules), "peering is off"
    assert not any(v in {"*", "escalate", "bind", "impersonate"} for _, _, v in rules)
    assert not any("*" in (g, r) for g, r, _ in rules)
    assert not any(r == "secrets" for _, r, _ in rules), "the operator only names Secrets in pod specs"
    binding = inst.one("ClusterRoleBinding", FULLNAME)
    assert binding["roleRef"]["name"] == FULLNAME
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_rbac_namespaced_keeps_only_discovery_cluster_wide(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "namespaced-ha")
    cluster = _rules(inst.one("ClusterRole", FULLNAME))
    # Cluster-scoped reads only: kopf's CRD and namespace scanning.
    assert cluster == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    for ns in ("team-a", "team-b"):
        role = _rules(inst.one("Role", FULLNAME, ns))
        assert ("kubeinfer.dev", "inferencemodels/status", "patch") in role
        assert ("kopf.dev", "kopfpeerings", "patch") in role
        binding = inst.one("RoleBinding", FULLNAME, ns)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": FULLNAME,
        }
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    # The same namespaced rules as the cluster-wide ClusterRole, less the peering kind swap.
    clusterwide = _rules(_ok(installs, "clusterwide-ha").one("ClusterRole", FULLNAME))
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in clusterwide
    team_a = _rules(inst.one("Role", FULLNAME, "team-a"))
    swap = {("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    cswap = {("kopf.dev", "clusterkopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    namespaces = {("", "namespaces", "list"), ("", "namespaces", "watch")}
    assert (team_a - swap) | (cluster - namespaces) == clusterwide - cswap


def test_replicas_without_peering_are_refused(installs: dict[str, HelmInstall]) -> None:
    inst = installs["replicas-without-peering"]
    assert not inst.ok
    assert "peering.enabled" in inst.error
    assert inst.find("Deployment") == []


def test_dashboards_arrive_as_sidecar_configmaps(installs: dict[str, HelmInstall]) -> None:
    files = {p.name: json.loads(p.read_text()) for p in CHART_DASHBOARDS.glob("*.json")}
    for scenario, ns in (("defaults", NAMESPACE), ("namespaced-ha", "monitoring")):
        maps = [
            c
            for c in _ok(installs, scenario).find("ConfigMap")
            if "grafana_dashboard" in c["metadata"]["labels"]
        ]
        assert len(maps) == len(files)
        shipped = {}
        for cm in maps:
            assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert cm["metadata"]["namespace"] == ns
            shipped.update({k: json.loads(v) for k, v in cm["data"].items()})
        assert shipped == files
    cm = next(
        c
        for c in _ok(installs, "namespaced-ha").find("ConfigMap", namespace="monitoring")
        if "grafana_dashboard" in c["metadata"]["labels"]
    )
    assert cm["metadata"]["annotations"]["grafana_folder"] == "kubeinfer"


def test_prometheusrule_carries_the_rules_file(installs: dict[str, HelmInstall]) -> None:
    assert _ok(installs, "defaults").find("PrometheusRule") == []
    rule = _ok(installs, "namespaced-ha").one("PrometheusRule", FULLNAME, NAMESPACE)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    # Helm left the alerts' own templates for Prometheus to expand.
    annotations = [r["annotations"]["summary"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all("{{ $labels." in a for a in annotations)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) missing")
def test_promtool_accepts_the_installed_prometheusrule_groups(
    installs: dict[str, HelmInstall], tmp_path: Path
) -> None:
    rule = _ok(installs, "namespaced-ha").one("PrometheusRule", FULLNAME, NAMESPACE)
    groups = tmp_path / "groups.yaml"
    groups.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(groups)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 6 rules found" in proc.stdout


# The PrometheusRule fields this chart uses, trimmed from prometheus-operator's
# monitoring.coreos.com_prometheusrules CRD (openAPIV3Schema), with unknown fields rejected the way
# the API server's strict field validation does.
PROMETHEUSRULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": {
                                            "type": "string",
                                            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                                        },
                                        "keep_firing_for": {"type": "string"},
                                        "labels": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
SERVICEMONITOR_SCHEMA = (
    REPO / "tests" / "operator" / "schemas" / "servicemonitor.monitoring.coreos.com_v1.json"
)


def test_monitoring_objects_match_their_crd_schemas(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "namespaced-ha")
    rule = inst.one("PrometheusRule", FULLNAME, NAMESPACE)
    jsonschema.validate(rule, PROMETHEUSRULE_SCHEMA)
    bad = json.loads(json.dumps(rule))
    bad["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, PROMETHEUSRULE_SCHEMA)
    if not SERVICEMONITOR_SCHEMA.exists():
        pytest.skip(f"{SERVICEMONITOR_SCHEMA} (the operator's trimmed ServiceMonitor schema) is missing")
    jsonschema.validate(
        inst.one("ServiceMonitor", FULLNAME, NAMESPACE), json.loads(SERVICEMONITOR_SCHEMA.read_text())
    )


def test_servicemonitor_targets_the_operator_service(installs: dict[str, HelmInstall]) -> None:
    assert _ok(installs, "defaults").find("ServiceMonitor") == []
    inst = _ok(installs, "namespaced-ha")
    monitor = inst.one("ServiceMonitor", FULLNAME, NAMESPACE)
    service = inst.one("Service", FULLNAME, NAMESPACE)
    pod_labels = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]["metadata"]["labels"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_prometheus_adapter_rules_ship_verbatim(installs: dict[str, HelmInstall]) -> None:
    assert not [c for c in _ok(installs, "defaults").find("ConfigMap") if "adapter" in c["metadata"]["name"]]
    cm = _ok(installs, "namespaced-ha").one("ConfigMap", f"{FULLNAME}-prometheus-adapter", "monitoring")
    source = CHART / "adapter" / "prometheus-adapter-rules.yaml"
    assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml.safe_load(source.read_text())


def test_notes_tell_the_user_what_to_apply_next(installs: dict[str, HelmInstall]) -> None:
    notes = _ok(installs, "defaults").release["info"]["notes"]
    assert "kind: InferenceModel" in notes and "kubectl apply -f -" in notes
    assert "kubectl get inferencemodels" in notes
    # The example in the notes is a valid InferenceModel apiVersion of the shipped CRD.
    crd = yaml.safe_load(next((CHART / "crds").glob("*.yaml")).read_text())
    versions = [v["name"] for v in crd["spec"]["versions"] if v.get("served")]
    assert any(f"apiVersion: {crd['spec']['group']}/{v}" in notes for v in versions)
    # The sample request asks for the name the sample model is served under (no 404 on copy-paste).
    example = yaml.safe_load(notes.split("kubectl apply -f -\n", 1)[1].split("YAML", 1)[0])
    from kubeinfer_operator.spec import InferenceModel

    served = InferenceModel.from_manifest(example).spec.served_name
    assert f'"model": "{served}"' in notes


def test_gateway_routes_every_model_in_the_namespace(installs: dict[str, HelmInstall]) -> None:
    """vllm-router in multi-model mode, discovering the release namespace's model servers (the label
    the operator puts on every server pod) with health checks on /ready, RBAC that only reads pods, and
    a pod that meets Pod Security "restricted"."""
    from kubeinfer_operator.render import selector_labels
    from kubeinfer_operator.spec import DEFAULT_ROUTER_IMAGE, InferenceModel

    assert not any(o["metadata"]["name"].endswith("-gateway") for o in _ok(installs, "defaults").objects)
    inst = _ok(installs, "gateway")
    name = f"{FULLNAME}-gateway"
    dep = inst.one("Deployment", name)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == DEFAULT_ROUTER_IMAGE
    args = c["args"]
    assert "--enable-igw" in args and "--service-discovery" in args
    assert f"--service-discovery-namespace={NAMESPACE}" in args and "--health-check-endpoint=/ready" in args
    im = InferenceModel.from_manifest(
        {
            "apiVersion": "kubeinfer.dev/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": "any", "namespace": NAMESPACE},
            "spec": {"model": {"uri": "hf://org/model"}},
        }
    )
    server_name = selector_labels(im)["app.kubernetes.io/name"]
    assert args[args.index("--selector") + 1] == f"app.kubernetes.io/name={server_name}"
    role = inst.one("Role", name)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert inst.one("RoleBinding", name)["subjects"][0]["name"] == name
    assert {p["port"] for p in inst.one("Service", name)["spec"]["ports"]} == {8000, 29000}
    assert inst.one("PodDisruptionBudget", name)["spec"]["maxUnavailable"] == 1
    assert inst.one("ServiceMonitor", name)["spec"]["endpoints"][0]["port"] == "metrics"
    pod = {**dep["spec"]["template"]["spec"], "metadata": dep["spec"]["template"].get("metadata") or {}}
    for rule, check in RULES.items():
        assert check(pod) == [], rule
