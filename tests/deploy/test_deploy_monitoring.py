"""Dashboards and alerts without a cluster: single source, PromQL that parses, only our metric names."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_helpers import (
    CHART,
    CHART_DASHBOARDS,
    KSM_ALLOWED,
    ROUTER_SERIES,
    RULES_FILE,
    TOP_DASHBOARDS,
    activator_series_names,
    dashboard_queries,
    documented_series_names,
    load_alert_rules,
    load_dashboards,
    metric_names,
    strip_threshold,
    substitute_grafana_vars,
    variable_selectors,
    vector_selectors,
)


def test_top_level_dashboards_are_the_charts_files() -> None:
    chart_files = {p.name: p.read_bytes() for p in CHART_DASHBOARDS.glob("*.json")}
    top_files = {p.name: p.read_bytes() for p in TOP_DASHBOARDS.glob("*.json")}
    assert chart_files, "the chart ships no dashboard"
    assert top_files == chart_files, (
        "dashboards/ must be a byte-identical copy of charts/kubeinfer/dashboards/ "
        "(the chart's copy is the source: cp charts/kubeinfer/dashboards/*.json dashboards/)"
    )


def test_dashboards_are_importable_grafana_json() -> None:
    for name, dash in load_dashboards().items():
        assert dash["uid"] and len(dash["uid"]) <= 40, name
        assert dash["title"] and dash["schemaVersion"] >= 36, name
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        # Per model and namespace, with a selectable Prometheus data source.
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for var in ("namespace", "model_name"):
            assert variables[var]["multi"] and variables[var]["includeAll"], var
            assert variables[var]["allValue"] == ".*", var
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in dash["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            assert panel.get("description"), panel["title"]


def _grafana_expr(expr: str) -> str:
    return substitute_grafana_vars(expr)


def test_every_dashboard_query_parses_and_reads_only_our_metrics() -> None:
    allowed = documented_series_names() | KSM_ALLOWED | ROUTER_SERIES | activator_series_names()
    queries = dashboard_queries()
    assert len(queries) >= 20
    for q in queries:
        names = metric_names(_grafana_expr(q.expr))
        assert names, f"{q.panel}/{q.ref} reads no metric"
        assert names <= allowed, f"{q.panel}/{q.ref} reads unknown metrics {sorted(names - allowed)}"
    for var, selector in variable_selectors():
        assert metric_names(_grafana_expr(selector)) <= allowed, var


def test_dashboard_queries_filter_by_the_selected_namespace_and_model() -> None:
    for q in dashboard_queries():
        for sel in vector_selectors(q.expr.replace("$__rate_interval", "1m")):
            matchers = {m.name: m.value for m in sel.matchers.matchers}
            assert matchers.get("namespace") == "$namespace", f"{q.panel}/{q.ref}: {sel}"
            if (sel.name or "").startswith("vllm:"):
                assert matchers.get("model_name") == "$model_name", f"{q.panel}/{q.ref}: {sel}"


def _exprs_by_metric() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for q in dashboard_queries():
        for name in metric_names(_grafana_expr(q.expr)):
            out.setdefault(name, []).append(q.expr)
    return out


def test_dashboards_cover_every_signal_the_issue_asks_for() -> None:
    by_metric = _exprs_by_metric()
    for counter in (
        "vllm:request_success_total",
        "kubeinfer_http_requests_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        assert any(f"rate({counter}" in e for e in by_metric.get(counter, [])), counter
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert gauge in by_metric, gauge
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        exprs = by_metric.get(f"{hist}_bucket", [])
        for quantile in ("0.5", "0.99"):
            assert any(e.startswith(f"histogram_quantile({quantile},") for e in exprs), (hist, quantile)
    assert "kube_deployment_status_replicas_ready" in by_metric
    # Scale to zero: held requests and wake latency (issue 27).
    assert "kubeinfer_activator_held_requests" in by_metric
    assert any(
        "histogram_quantile" in e for e in by_metric.get("kubeinfer_activator_wake_seconds_bucket", [])
    )
    # The router: request rate, per-replica load, cache-hit routing, replica health.
    assert set(by_metric) >= ROUTER_SERIES, sorted(ROUTER_SERIES - set(by_metric))
    assert any("rate(vllm_router_requests_total" in e for e in by_metric["vllm_router_requests_total"])
    assert any('outcome="prefix_hit"' in e for e in by_metric["vllm_router_prefix_routing_decisions_total"])
    assert any('status=~"5.."' in e for e in by_metric["kubeinfer_http_requests_total"])


REQUIRED_ALERTS = {
    "KubeinferQueueBackingUp": "vllm:num_requests_waiting",
    "KubeinferKVCacheAlmostFull": "vllm:kv_cache_usage_perc",
    "KubeinferTimeToFirstTokenHigh": "vllm:time_to_first_token_seconds_bucket",
    "KubeinferPreemptionsRising": "vllm:num_preemptions_total",
    "KubeinferReplicasNotReady": "kube_deployment_status_replicas_ready",
    "KubeinferHighErrorRate": "kubeinfer_http_requests_total",
}


def test_alerts_parse_read_only_our_metrics_and_are_complete() -> None:
    allowed = documented_series_names() | KSM_ALLOWED
    rules = {r.name: r for r in load_alert_rules()}
    assert set(rules) == set(REQUIRED_ALERTS)
    for name, metric in REQUIRED_ALERTS.items():
        rule = rules[name]
        names = metric_names(rule.expr)
        assert metric in names, name
        assert names <= allowed, f"{name} reads unknown metrics {sorted(names - allowed)}"
        metric_names(strip_threshold(rule.expr))  # the measured side parses on its own
        assert rule.for_, f"{name} would fire on a single evaluation"
        assert rule.labels.get("severity") in {"warning", "critical"}, name
        assert rule.annotations.get("summary") and rule.annotations.get("description"), name
    kv = rules["KubeinferKVCacheAlmostFull"].expr
    assert "> 0.95" in " ".join(kv.split())
    assert "histogram_quantile(0.99" in " ".join(rules["KubeinferTimeToFirstTokenHigh"].expr.split())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) missing")
def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in proc.stdout
    # promtool must also reject a broken rule, or the check above proves nothing.
    doc = yaml.safe_load(RULES_FILE.read_text())
    doc["groups"][0]["rules"][0]["expr"] = "sum by (namespace) (vllm:num_requests_waiting >"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc))
    bad = subprocess.run(["promtool", "check", "rules", str(broken)], capture_output=True, check=False)
    assert bad.returncode != 0


def test_prometheusrule_template_ships_the_rules_file_verbatim() -> None:
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    assert '.Files.Get "rules/kubeinfer-alerts.yaml"' in template
