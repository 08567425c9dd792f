"""The prometheus-adapter rules the chart ships serve exactly the custom metric names the operator's
HPAs ask for: each server series matches a rule's seriesQuery, and the rule's name mapping (Go regexp
replacement, as the adapter applies it) turns it into the HPA's Pods metric name."""

from __future__ import annotations

import re

import promql_parser
import pytest
import yaml
from deploy_helpers import CHART
from kubeinfer_operator.render import METRIC_NAMES, pods_metric_name, render_hpa
from kubeinfer_operator.spec import InferenceModel

RULES = CHART / "adapter" / "prometheus-adapter-rules.yaml"


def _rules() -> list[dict]:  # type: ignore[type-arg]
    return list(yaml.safe_load(RULES.read_text())["rules"])


def _adapter_name(rule: dict, series: str) -> str | None:  # type: ignore[type-arg]
    """The adapter's naming: seriesQuery selects the series, name.matches/as renames it."""
    selector = promql_parser.parse(rule["seriesQuery"])
    for m in selector.matchers.matchers:
        if m.name == "__name__" and not re.fullmatch(m.value, series):
            return None
    name = rule.get("name") or {}
    pattern = name.get("matches", "^(.*)$")
    replacement = re.sub(r"\$\{(\d+)\}", r"\\\1", name.get("as", "${1}"))
    if not re.search(pattern, series):
        return None
    return re.sub(pattern, replacement, series)


@pytest.mark.parametrize("metric", sorted(METRIC_NAMES))
def test_every_hpa_metric_is_served_by_a_rule(metric: str) -> None:
    series = METRIC_NAMES[metric]
    served = {n for r in _rules() if (n := _adapter_name(r, series)) is not None}
    im = InferenceModel.from_manifest(
        {
            "apiVersion": "kubeinfer.dev/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {
                "model": {"uri": "hf://o/m"},
                "scaling": {"autoscaler": "HPA", "maxReplicas": 3, "metric": metric},
            },
        }
    )
    wanted = render_hpa(im)["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert wanted == pods_metric_name(metric)
    assert served == {wanted}


def test_rules_map_series_to_pods_and_namespaces() -> None:
    for rule in _rules():
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"] == {"resource": "pod"}
        assert overrides["namespace"] == {"resource": "namespace"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def test_a_foreign_series_is_not_served() -> None:
    assert all(_adapter_name(r, "vllm:num_preemptions_total") is None for r in _rules())
