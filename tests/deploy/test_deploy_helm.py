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

import crd_cel
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

REGISTRY = "registry.example.com:5000/mirror"
SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced-ha": {
        "operator": {"watchNamespaces": ["team-a", "team-b"], "replicas": 2},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
        "grafanaDashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "kubeinfer"}},
        "prometheusAdapter": {"rules": {"enabled": True, "namespace": "monitoring"}},
    },
    "clusterwide-ha": {
        "operator": {
            "replicas": 3,
            "verbose": True,
            "leaderElection": {"leaseDuration": "30s", "renewDeadline": "20s", "leaseName": "ki-lock"},
        },
        "prometheusRule": {"enabled": True},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
            }
        ],
    },
    "single": {"operator": {"replicas": 1, "leaderElection": {"enabled": False}}},
    "replicas-without-leader-election": {"operator": {"replicas": 2, "leaderElection": {"enabled": False}}},
    "old-peering-values": {"operator": {"peering": {"enabled": True}}},
    "gateway": {"gateway": {"enabled": True, "serviceMonitor": True}},
    "inference-extension": {"inferenceExtension": {"enabled": True}},
    "registry": {
        "global": {"imageRegistry": REGISTRY, "imagePullSecrets": [{"name": "mirror-pull"}]},
        "imagePullSecrets": [{"name": "operator-pull"}, {"name": "mirror-pull"}],
        "gateway": {"enabled": True},
    },
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


@pytest.mark.parametrize(
    "scenario",
    ["defaults", "namespaced-ha", "clusterwide-ha", "single", "gateway", "registry", "inference-extension"],
)
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


def _container(inst: HelmInstall) -> dict[str, Any]:
    spec = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]["spec"]
    container: dict[str, Any] = spec["containers"][0]
    return container


def test_operator_container_runs_the_operator_with_liveness_and_resources(
    installs: dict[str, HelmInstall],
) -> None:
    from kubeinfer_operator.__main__ import build_parser, leader_election_config

    inst = _ok(installs, "defaults")
    dep = inst.one("Deployment", FULLNAME, NAMESPACE)
    container = _container(inst)
    assert container["image"] == "ghcr.io/kubeinfer/operator:0.1.0"
    assert container["command"] == ["kubeinfer-operator"]
    args = container["args"]
    assert args[0] == "run" and "--all-namespaces" in args and "--standalone" not in args
    liveness = next(a for a in args if a.startswith("--liveness="))
    port = next(p for p in container["ports"] if p["name"] == container["livenessProbe"]["httpGet"]["port"])
    assert liveness == f"--liveness=http://0.0.0.0:{port['containerPort']}/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    # Two replicas, one reconciling: leader election with controller-runtime's timing, on a Lease in
    # the release namespace; the operator's own parser accepts the chart's arguments.
    assert dep["spec"]["replicas"] == 2
    parsed = build_parser().parse_args(args)
    assert parsed.leader_elect
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    config = leader_election_config(parsed)
    assert (config.lease_duration, config.renew_deadline, config.retry_period) == (15.0, 10.0, 2.0)
    assert (config.namespace, config.lease_name) == (NAMESPACE, FULLNAME)
    # A new pod waits for the Lease, so a rolling update never has two reconcilers.
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert inst.one("ServiceAccount", sa, NAMESPACE)


def test_replicas_spread_over_nodes_with_a_budget_that_never_blocks_a_drain(
    installs: dict[str, HelmInstall],
) -> None:
    inst = _ok(installs, "defaults")
    pod = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    pdb = inst.one("PodDisruptionBudget", FULLNAME, NAMESPACE)
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # The user's own affinity wins; spread constraints get the chart's selector.
    custom = _ok(installs, "clusterwide-ha").one("Deployment", FULLNAME, NAMESPACE)["spec"]
    assert custom["replicas"] == 3
    assert list(custom["template"]["spec"]["affinity"]) == ["nodeAffinity"]
    (spread,) = custom["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["labelSelector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]
    args = _container(_ok(installs, "clusterwide-ha"))["args"]
    assert "--leader-elect-lease-duration=30s" in args and "--leader-elect-resource-name=ki-lock" in args


def test_one_replica_without_leader_election_runs_standalone(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "single")
    dep = inst.one("Deployment", FULLNAME, NAMESPACE)
    args = _container(inst)["args"]
    assert "--standalone" in args and not any(a.startswith("--leader-elect") for a in args)
    # Without leader election two instances must never overlap, not even during a rollout.
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["spec"]["replicas"] == 1
    assert inst.find("PodDisruptionBudget") == []
    assert "affinity" not in dep["spec"]["template"]["spec"]
    assert not [r for r in inst.find("Role") if r["metadata"]["name"].endswith("-leader-election")]


def test_namespaced_mode_watches_only_listed_namespaces(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "namespaced-ha")
    args = _container(inst)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args and "--standalone" not in args
    assert "--leader-elect" in args and f"--leader-elect-resource-namespace={NAMESPACE}" in args


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


LEASE_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": [FULLNAME],
        "verbs": ["get", "update"],
    },
]


def test_rbac_leader_election_is_one_lease_in_the_release_namespace(installs: dict[str, HelmInstall]) -> None:
    for scenario in ("defaults", "namespaced-ha"):
        inst = _ok(installs, scenario)
        role = inst.one("Role", f"{FULLNAME}-leader-election", NAMESPACE)
        assert role["rules"] == LEASE_RULES
        binding = inst.one("RoleBinding", f"{FULLNAME}-leader-election", NAMESPACE)
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
        # Nowhere else: no Lease rule in a ClusterRole or in a watched namespace's Role.
        others = [r for r in inst.find("ClusterRole") + inst.find("Role") if r is not role]
        assert not any(g == "coordination.k8s.io" for r in others for g, _, _ in _rules(r))
    named = _ok(installs, "clusterwide-ha").one("Role", f"{FULLNAME}-leader-election", NAMESPACE)
    assert named["rules"][1]["resourceNames"] == ["ki-lock"]


def test_rbac_clusterwide_binds_one_clusterrole(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "defaults")
    # The only Role is leader election's (checked above).
    assert [r["metadata"]["name"] for r in inst.find("Role")] == [f"{FULLNAME}-leader-election"]
    assert [r["metadata"]["name"] for r in inst.find("RoleBinding")] == [f"{FULLNAME}-leader-election"]
    rules = _rules(inst.one("ClusterRole", FULLNAME))
    assert ("kubeinfer.dev", "inferencemodels", "watch") in rules
    assert ("apps", "deployments", "patch") in rules
    assert not any(g == "kopf.dev" for g, _, _ in rules), "no kopf peering"
    assert not any(v in {"*", "escalate", "bind", "impersonate"} for _, _, v in rules)
    assert not any("*" in (g, r) for g, r, _ in rules)
    # Secrets: created (each model's admin API key), never read, listed, changed or deleted
    assert {v for _, r, v in rules if r == "secrets"} == {"create"}, "the operator reads no Secret"
    binding = inst.one("ClusterRoleBinding", FULLNAME)
    assert binding["roleRef"]["name"] == FULLNAME
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_rbac_namespaced_keeps_only_discovery_cluster_wide(installs: dict[str, HelmInstall]) -> None:
    inst = _ok(installs, "namespaced-ha")
    cluster = _rules(inst.one("ClusterRole", FULLNAME))
    # Cluster-scoped reads only: kopf's CRD and namespace scanning, and the reconcile's read of a
    # model's Namespace (one being deleted is left alone).
    assert cluster == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "get"),
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    for ns in ("team-a", "team-b"):
        role = _rules(inst.one("Role", FULLNAME, ns))
        assert ("kubeinfer.dev", "inferencemodels/status", "patch") in role
        binding = inst.one("RoleBinding", FULLNAME, ns)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": FULLNAME,
        }
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    # The same namespaced rules as the cluster-wide ClusterRole.
    clusterwide = _rules(_ok(installs, "clusterwide-ha").one("ClusterRole", FULLNAME))
    team_a = _rules(inst.one("Role", FULLNAME, "team-a"))
    namespaces = {("", "namespaces", "list"), ("", "namespaces", "watch")}
    assert team_a | (cluster - namespaces) == clusterwide


def test_replicas_without_leader_election_are_refused(installs: dict[str, HelmInstall]) -> None:
    inst = installs["replicas-without-leader-election"]
    assert not inst.ok
    assert "leaderElection.enabled" in inst.error
    assert inst.find("Deployment") == []
    old = installs["old-peering-values"]
    assert not old.ok and "replaced by operator.leaderElection" in old.error


def test_global_registry_reaches_every_image_and_the_models_deployment(
    installs: dict[str, HelmInstall],
) -> None:
    """global.imageRegistry and global.imagePullSecrets: the operator's image and pod, the gateway, and
    through the operator's environment the pods it renders for an InferenceModel without an image."""
    from kubeinfer_operator.defaults import ClusterDefaults
    from kubeinfer_operator.render import Capabilities, render_all
    from kubeinfer_operator.spec import InferenceModel

    inst = _ok(installs, "registry")
    container = _container(inst)
    assert container["image"] == f"{REGISTRY}/kubeinfer/operator:0.1.0"
    pod = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "mirror-pull"}, {"name": "operator-pull"}]
    gateway = inst.one("Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    assert gateway["containers"][0]["image"] == f"{REGISTRY}/kubeinfer/router:0.1.17"
    assert gateway["imagePullSecrets"] == [{"name": "mirror-pull"}]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["KUBEINFER_DEFAULT_SERVER_IMAGE"] == f"{REGISTRY}/kubeinfer/server:0.1.0"
    assert env["KUBEINFER_DEFAULT_SERVER_CPU_IMAGE"] == f"{REGISTRY}/kubeinfer/server:0.1.0-cpu"
    assert env["KUBEINFER_DEFAULT_ROUTER_IMAGE"] == f"{REGISTRY}/kubeinfer/router:0.1.17"
    assert env["KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS"] == "mirror-pull"

    # What the operator renders with that environment (handlers read it the same way).
    defaults = ClusterDefaults.from_environment(env)
    doc: dict[str, Any] = {
        "apiVersion": "kubeinfer.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "m", "namespace": "team-a", "uid": "u"},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "routing": {"enabled": True},
            "pod": {"imagePullSecrets": [{"name": "own"}]},
        },
    }

    def deployments(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
        objects = render_all(InferenceModel.from_manifest(d), Capabilities(defaults=defaults)).objects
        return {
            o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"
        }

    deps = deployments(doc)
    server, router = deps["m"], deps["m-router"]
    # No resources.gpu: CPU (the default count 0), the CPU image; a GPU model gets the CUDA one.
    assert server["containers"][0]["image"] == f"{REGISTRY}/kubeinfer/server:0.1.0-cpu"
    gpu_doc = {**doc, "spec": {**doc["spec"], "resources": {"gpu": {"count": 1}}}}
    assert deployments(gpu_doc)["m"]["containers"][0]["image"] == f"{REGISTRY}/kubeinfer/server:0.1.0"
    assert server["imagePullSecrets"] == [{"name": "own"}, {"name": "mirror-pull"}]
    assert router["containers"][0]["image"] == f"{REGISTRY}/kubeinfer/router:0.1.17"
    assert router["imagePullSecrets"] == [{"name": "mirror-pull"}]
    full = render_all(InferenceModel.from_manifest(doc), Capabilities(defaults=defaults)).objects
    for obj in full:
        if obj["kind"] == "Deployment":
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
    # A model's own image still wins.
    doc["spec"]["engine"] = {"image": "example.org/own/server:1"}
    assert deployments(doc)["m"]["containers"][0]["image"] == "example.org/own/server:1"
    # Without a registry the chart's defaults are the operator's built-in ones.
    plain = {e["name"]: e["value"] for e in _container(_ok(installs, "defaults"))["env"] if "value" in e}
    chart_defaults, builtin = ClusterDefaults.from_environment(plain), ClusterDefaults()
    for attr in ("server_image", "router_image", "image_pull_secrets"):
        assert getattr(chart_defaults, attr) == getattr(builtin, attr), attr


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


@pytest.mark.parametrize("scenario", ["defaults", "namespaced-ha"])
def test_operator_network_policy_admits_what_the_operator_needs(
    installs: dict[str, HelmInstall], scenario: str
) -> None:
    """The chart's NetworkPolicy evaluated against the operator pod's labels (tests/netpol_eval.py)."""
    from netpol_eval import Pod as NetPod
    from netpol_eval import admits

    inst = _ok(installs, scenario)
    policies = inst.find("NetworkPolicy")
    assert [p["metadata"]["name"] for p in policies] == [FULLNAME]
    template = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["template"]
    operator = NetPod(NAMESPACE, dict(template["metadata"]["labels"]))
    stranger = NetPod("team-a", {"app": "x"})
    model = NetPod(
        "team-a", {"app.kubernetes.io/name": "kubeinfer-server", "app.kubernetes.io/instance": "m"}
    )
    router = NetPod(
        "team-a", {"app.kubernetes.io/name": "kubeinfer-router", "app.kubernetes.io/instance": "m"}
    )
    api_server = NetPod("default", {"component": "apiserver"})  # ports are what the egress rule checks
    prometheus = NetPod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    # in: the health port; the metrics port only from Prometheus (when the chart serves one)
    assert admits(policies, stranger, operator, 8080)
    assert not admits(policies, stranger, operator, 5000)
    if scenario == "namespaced-ha":
        assert admits(policies, prometheus, operator, 9090)
        assert not admits(policies, stranger, operator, 9090)
    # out: the model pods' API, the API server's ports and DNS; nothing else
    assert admits(policies, operator, model, 8080)
    assert not admits(policies, operator, model, 5557) and not admits(policies, operator, router, 8000)
    for port in (443, 6443):
        assert admits(policies, operator, api_server, port)
    assert admits(policies, operator, api_server, 53, "UDP")
    assert not admits(policies, operator, stranger, 80)
    env = {e["name"]: e.get("value") for e in _container(inst)["env"]}
    # the labels the models' policies admit the operator by: exactly its pods' selector labels
    pairs = dict(p.split("=", 1) for p in env["KUBEINFER_OPERATOR_POD_LABELS"].split(","))
    selector = inst.one("Deployment", FULLNAME, NAMESPACE)["spec"]["selector"]["matchLabels"]
    assert pairs == selector
    assert env["KUBEINFER_MONITORING_NAMESPACE"] == "monitoring"
    assert env["KUBEINFER_PROMETHEUS_POD_LABELS"] == "app.kubernetes.io/name=prometheus"


def test_network_policy_can_be_turned_off(tmp_path: Path) -> None:
    inst = asyncio.run(helm_install({"networkPolicy": {"enabled": False}}, tmp_path, NAMESPACE, RELEASE))
    assert inst.ok, inst.error
    assert inst.find("NetworkPolicy") == []


def test_inference_extension_rbac_only_when_asked(installs: dict[str, HelmInstall]) -> None:
    """inferenceExtension.enabled grants the operator the InferencePool and HTTPRoute rules and the
    endpoint picker's read rules it hands on (RBAC lets it grant only what it holds); the default
    install grants none of them."""
    from kubeinfer_operator.gateway import EPP_RULES

    def rules(name: str) -> list[dict[str, Any]]:
        inst = _ok(installs, name)
        return [r for o in inst.find("ClusterRole") + inst.find("Role") for r in o.get("rules") or []]

    def granted(rule_set: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
        return any(
            group in r.get("apiGroups", [])
            and resource in r.get("resources", [])
            and verb in r.get("verbs", [])
            for r in rule_set
        )

    on, off = rules("inference-extension"), rules("defaults")
    for group, resource in (
        ("inference.networking.k8s.io", "inferencepools"),
        ("gateway.networking.k8s.io", "httproutes"),
    ):
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert granted(on, group, resource, verb), (resource, verb)
            assert not granted(off, group, resource, verb), (resource, verb)
    for rule in EPP_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert granted(on, group, resource, verb), (group, resource, verb)
    env = {e["name"]: e.get("value") for e in _container(_ok(installs, "inference-extension"))["env"]}
    assert (
        env["KUBEINFER_DEFAULT_ENDPOINT_PICKER_IMAGE"]
        == "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
    )
    assert env["KUBEINFER_INFERENCE_EXTENSION"] == "true"
    off = {e["name"]: e.get("value") for e in _container(_ok(installs, "defaults"))["env"]}
    assert off["KUBEINFER_INFERENCE_EXTENSION"] == "false"


def test_the_operator_cannot_mint_service_account_tokens(installs: dict[str, HelmInstall]) -> None:
    """Issue 45 item 5: `secrets: create` let the operator create a kubernetes.io/service-account-token
    Secret for any ServiceAccount of a watched namespace; the chart's ValidatingAdmissionPolicy refuses
    every Secret of the operator's ServiceAccount that is not a plain Opaque one (its CEL evaluated
    here as the API server would on the admission request)."""
    inst = _ok(installs, "defaults")
    (policy,) = inst.find("ValidatingAdmissionPolicy")
    (binding,) = inst.find("ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"][0]["resources"] == ["secrets"]
    operator_user = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"
    (match,) = spec["matchConditions"]
    for user, applies in ((operator_user, True), ("system:serviceaccount:models:default", False)):
        assert (
            crd_cel.evaluate_vars(match["expression"], {"request": {"userInfo": {"username": user}}})
            is applies
        )

    def allowed(secret: dict[str, Any]) -> bool:
        return all(
            crd_cel.evaluate_vars(v["expression"], {"object": secret}) is True for v in spec["validations"]
        )

    token = {
        "metadata": {"name": "t", "annotations": {"kubernetes.io/service-account.name": "admin"}},
        "type": "kubernetes.io/service-account-token",
    }
    assert not allowed(token)
    assert not allowed({**token, "type": "Opaque"})
    assert not allowed({"metadata": {"name": "t"}, "type": "kubernetes.io/dockerconfigjson"})
    assert allowed({"metadata": {"name": "m-admin-0123456789"}, "type": "Opaque"})
