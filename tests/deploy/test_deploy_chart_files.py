"""The chart's files without Helm: CRDs identical to crds/, a documented values.yaml, versions that agree."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

import yaml
from deploy_helpers import CHART, REPO


def test_chart_crds_are_identical_to_the_top_level_crds() -> None:
    top = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "crds/ is empty"
    assert chart == top, (
        "charts/kubeinfer/crds/ must be a byte-identical copy of crds/ (cp crds/*.yaml charts/kubeinfer/crds/)"
    )
    for text in chart.values():
        crd = yaml.safe_load(text)
        assert crd["kind"] == "CustomResourceDefinition"
        assert crd["spec"]["group"] == "kubeinfer.dev"


def test_chart_versions_match_the_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # The default image is the appVersion tag of the image Dockerfile.operator builds.
    assert values["image"]["tag"] == ""
    assert values["image"]["repository"] == "ghcr.io/kubeinfer/operator"
    assert (
        f'org.opencontainers.image.version="{project["version"]}"'
        in (REPO / "Dockerfile.operator").read_text()
    )


@dataclass
class _Key:
    name: str
    indent: int
    documented: bool  # a `# --` comment right above the key
    children: list[_Key] = field(default_factory=list)


def _key_tree(text: str) -> list[_Key]:
    lines = text.splitlines()
    roots: list[_Key] = []
    stack: list[_Key] = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_][A-Za-z0-9_]*):(\s|$)", line)
        if not match:
            continue
        j, comment = i - 1, []
        while j >= 0 and lines[j].strip().startswith("#"):
            comment.append(lines[j])
            j -= 1
        node = _Key(match[2], len(match[1]), any("# --" in c for c in comment))
        while stack and stack[-1].indent >= node.indent:
            stack.pop()
        (stack[-1].children if stack else roots).append(node)
        stack.append(node)
    return roots


def _documented(node: _Key) -> bool:
    """Documented itself, or a section whose every entry is (a documented map needs no per-field notes)."""
    return node.documented or (bool(node.children) and all(_documented(c) for c in node.children))


def test_every_value_is_documented() -> None:
    roots = _key_tree((CHART / "values.yaml").read_text())
    assert len(roots) >= 15
    missing = [r.name for r in roots if not _documented(r)]
    assert missing == [], f"values.yaml entries without a `# --` comment: {missing}"
    # The check itself finds an undocumented knob.
    assert not _documented(_key_tree("image:\n  # -- ok\n  tag: x\n  pullPolicy: y\n")[0])


def test_kube_version_floor_covers_the_prestop_sleep_action() -> None:
    from kubeinfer_operator.render import render_deployment
    from kubeinfer_operator.spec import InferenceModel

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    floor = re.match(r"^>=\s*1\.(\d+)", chart["kubeVersion"])
    assert floor is not None
    im = InferenceModel.from_manifest(
        {
            "apiVersion": "kubeinfer.dev/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": "m"},
            "spec": {"model": {"uri": "hf://o/m"}},
        }
    )
    (c,) = render_deployment(im)["spec"]["template"]["spec"]["containers"]
    if "sleep" in c["lifecycle"]["preStop"]:
        assert int(floor.group(1)) >= 30, "lifecycle.preStop.sleep is GA only from Kubernetes 1.30"


def test_the_mock_api_server_admits_the_chart_crds() -> None:
    from kmock_crd import crd_refusal

    for path in sorted((CHART / "crds").glob("*.yaml")):
        assert crd_refusal(yaml.safe_load(path.read_text())) is None, path.name


def _refusal_message(edit: Any) -> str:
    from kmock_crd import crd_refusal

    crd = yaml.safe_load((REPO / "crds" / "kubeinfer.dev_inferencemodels.yaml").read_text())
    edit(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])
    refusal = crd_refusal(crd)
    assert refusal is not None and refusal.status == 422 and refusal.reason == "Invalid"
    message = str(refusal.message)
    name = "inferencemodels.kubeinfer.dev"
    assert message.startswith(f'CustomResourceDefinition.apiextensions.k8s.io "{name}" is invalid: [')
    return message


def test_the_mock_api_server_refuses_a_default_that_fails_its_rules() -> None:
    # A real API server (v1.36.2) refused our CRD so (issue 29 F1), in these words.
    def edit(spec: dict[str, Any]) -> None:
        spec["scaling"]["default"] = {}

    assert _refusal_message(edit).endswith(
        '[spec.validation.openAPIV3Schema.properties[spec].properties[scaling].default: Invalid value: "object": '
        "no such key: autoscaler evaluating rule: without an autoscaler, scaling.replicas must lie within "
        "[minReplicas, maxReplicas], "
        'spec.validation.openAPIV3Schema.properties[spec].properties[scaling].default: Invalid value: "object": '
        "no such key: autoscaler evaluating rule: an autoscaler needs scaling.maxReplicas, "
        'spec.validation.openAPIV3Schema.properties[spec].properties[scaling].default: Invalid value: "object": '
        "no such key: autoscaler evaluating rule: scaling.autoscaler KEDA needs scaling.prometheusAddress, "
        'spec.validation.openAPIV3Schema.properties[spec].properties[scaling].default: Invalid value: "object": '
        "no such key: autoscaler evaluating rule: an HPA cannot scale to zero (minReplicas >= 1); use KEDA for "
        "scale-to-zero]"
    )


def test_the_mock_api_server_refuses_a_rule_over_its_cost_budget() -> None:
    # ... and so, once the defaults held (issue 29 F2).
    def edit(spec: dict[str, Any]) -> None:
        labels = spec["pod"]["properties"]["labels"]
        del labels["maxProperties"], labels["additionalProperties"]["maxLength"]

    message = _refusal_message(edit)
    assert (
        "spec.validation.openAPIV3Schema.properties[spec].properties[pod].x-kubernetes-validations[0].rule: "
        "Forbidden: estimated rule cost exceeds budget by factor of more than 100x (try simplifying the rule, "
        "or adding maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)"
    ) in message
