"""The dashboards and alerts against a real Prometheus scraping a real server under load.

Debian's `prometheus` runs on 127.0.0.1 with a 1 s scrape and rule interval, scraping `python -m server`
(a tiny random-weight Llama, so the load finishes in seconds) and a stand-in for kube-state-metrics
that serves the three KSM series the replica panels read, with KSM's names and labels. After a small
load (OpenAI and TGI requests, concurrent, with repeated prompts and a few rejected ones) every
dashboard query, every template variable and every alert's measured quantity must return series,
Prometheus must have loaded every alert with health "ok", and every metric name the dashboards and
alerts use must appear in the server's own /metrics (or in the documented KSM allow-list).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_helpers import (
    KSM_ALLOWED,
    REPO,
    ROUTER_SERIES,
    RULES_FILE,
    activator_series_names,
    dashboard_queries,
    load_alert_rules,
    metric_names,
    strip_threshold,
    substitute_grafana_vars,
    variable_selectors,
)
from serving import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="Debian's prometheus package is not installed (apt-get install prometheus)",
    ),
]

NAMESPACE = "kubeinfer-test"
MODEL = "tiny"  # --served-model-name: the model_name label
DEPLOYMENT = "tiny"  # what the operator names the Deployment (the InferenceModel's name)

KSM_TEXT = f"""# HELP kube_deployment_status_replicas_ready The number of ready replicas per deployment.
# TYPE kube_deployment_status_replicas_ready gauge
kube_deployment_status_replicas_ready{{namespace="{NAMESPACE}",deployment="{DEPLOYMENT}"}} 1
# HELP kube_deployment_spec_replicas Number of desired pods for a deployment.
# TYPE kube_deployment_spec_replicas gauge
kube_deployment_spec_replicas{{namespace="{NAMESPACE}",deployment="{DEPLOYMENT}"}} 1
# HELP kube_deployment_labels Kubernetes labels converted to Prometheus labels.
# TYPE kube_deployment_labels gauge
kube_deployment_labels{{namespace="{NAMESPACE}",deployment="{DEPLOYMENT}",label_app_kubernetes_io_managed_by="kubeinfer-operator"}} 1
"""


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass(frozen=True)
class Stack:
    server_url: str
    prometheus_url: str
    server_log: Path
    prometheus_log: Path
    load_start: float = 0.0  # epoch seconds, around the load the fixture sends
    load_end: float = 0.0


class _KsmHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = KSM_TEXT.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def stack(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prom")
    model_dir = tiny_model_factory()
    server_port, prom_port = free_port(), free_port()
    ksm = ThreadingHTTPServer(("127.0.0.1", 0), _KsmHandler)
    threading.Thread(target=ksm.serve_forever, daemon=True).start()

    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("API_KEY", None)
    server_log = tmp / "server.log"
    # Few KV blocks and a small batch: requests queue up and the KV cache fills under the load.
    server_cmd = [
        sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(server_port),
        "--model", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
        "--num-kv-blocks", "16", "--block-size", "16", "--max-num-seqs", "2", "--max-total-tokens", "256",
        "--enable-prefix-caching", "--num-threads", "1", "--log-format", "text",
    ]  # fmt: skip
    with open(server_log, "wb") as log:
        server = subprocess.Popen(server_cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [
            {
                # What the operator's ServiceMonitor gives: job = Service name, namespace and pod labels.
                "job_name": DEPLOYMENT,
                "metrics_path": "/metrics",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{server_port}"],
                        "labels": {"namespace": NAMESPACE, "pod": f"{DEPLOYMENT}-0", "service": DEPLOYMENT},
                    }
                ],
            },
            {
                "job_name": "kube-state-metrics",
                "honor_labels": True,  # as KSM is scraped: its namespace label is the object's
                "static_configs": [{"targets": [f"127.0.0.1:{ksm.server_address[1]}"]}],
            },
        ],
    }
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    prometheus_log = tmp / "prometheus.log"
    prom_cmd = [
        "prometheus", f"--config.file={config_path}", f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h",
    ]  # fmt: skip
    with open(prometheus_log, "wb") as log:
        prometheus = subprocess.Popen(prom_cmd, stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(
        server_url=f"http://127.0.0.1:{server_port}",
        prometheus_url=f"http://127.0.0.1:{prom_port}",
        server_log=server_log,
        prometheus_log=prometheus_log,
    )
    try:
        wait_until(
            "the server to load the model",
            lambda: (
                server.poll() is None and httpx.get(f"{stack.server_url}/ready", timeout=2).status_code == 200
            ),
            timeout=300,
        )
        wait_until(
            "Prometheus to start",
            lambda: httpx.get(f"{stack.prometheus_url}/-/ready", timeout=2).status_code == 200,
            timeout=120,
        )
        # A scrape before the load: the counters' pre-load values are in the TSDB, so a rate over a window
        # that holds them and any later scrape measures the load (a load over before the first scrape left
        # only flat samples, and a zero rate, on a loaded CI machine).
        wait_until(
            "Prometheus to scrape the server before the load",
            lambda: bool(_query(stack, f'vllm:generation_tokens_total{{job="{DEPLOYMENT}"}}')),
            timeout=120,
        )
        load_start = time.time()
        _load(stack.server_url)
        yield replace(stack, load_start=load_start, load_end=time.time())
    except AssertionError:
        tail = (
            server_log.read_text(errors="replace")[-3000:]
            + prometheus_log.read_text(errors="replace")[-3000:]
        )
        raise AssertionError(tail) from None
    finally:
        _stop(server)
        _stop(prometheus)
        ksm.shutdown()


PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find",
    "Kubernetes schedules pods onto nodes; an operator watches custom resources and",
]


def _load(url: str) -> None:
    """A small, bounded load: concurrent completions (queueing), repeats (prefix hits), a few 4xx."""

    def completion(i: int) -> int:
        body = {"model": MODEL, "prompt": PROMPTS[i % 2] * 2, "max_tokens": 24, "temperature": 0.0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code

    def tgi(i: int) -> int:
        body = {"inputs": PROMPTS[i % 2], "parameters": {"max_new_tokens": 16}}
        return httpx.post(f"{url}/generate", json=body, timeout=120).status_code

    with ThreadPoolExecutor(max_workers=6) as pool:
        codes = list(pool.map(completion, range(12))) + list(pool.map(tgi, range(4)))
    assert codes.count(200) >= 12, codes
    # Rejected requests, for the per-status HTTP and per-error failure series (4xx, never 5xx).
    for _ in range(3):
        bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "max_tokens": -1}, timeout=30)
        assert 400 <= bad.status_code < 500, bad.status_code
        bad = httpx.post(
            f"{url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 0}}, timeout=30
        )
        assert 400 <= bad.status_code < 500, bad.status_code


def _query(stack: Stack, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"query": expr} if at is None else {"query": expr, "time": at}
    r = httpx.get(f"{stack.prometheus_url}/api/v1/query", params=params, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _first_scrape_after(stack: Stack, metric: str, after: float, timeout: float) -> float:
    """The timestamp (epoch s) of the first sample of `metric` Prometheus scraped after `after`."""
    found: list[float] = []

    def check() -> bool:
        for series in _query(stack, f"{metric}[10m]"):
            found.extend(float(ts) for ts, _ in series["values"] if float(ts) > after)
        return bool(found)

    wait_until(f"a scrape of {metric} after the load", check, timeout=timeout)
    return min(found)


def _query_range(stack: Stack, expr: str, start: float, end: float) -> list[float]:
    """Every value of `expr` evaluated at 1 s steps over [start, end], as a dashboard graph draws it."""
    params = {"query": expr, "start": start, "end": end, "step": 1}
    r = httpx.get(f"{stack.prometheus_url}/api/v1/query_range", params=params, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return [float(v) for series in body["data"]["result"] for _, v in series["values"]]


def _all_have_data(stack: Stack, exprs: dict[str, str], timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Polls until every expression returns series (scrapes are 1 s apart; rate() needs two)."""
    results: dict[str, list[dict[str, Any]]] = {}

    def check() -> bool:
        for key, expr in exprs.items():
            if not results.get(key):
                results[key] = _query(stack, expr)
        return all(results.values())

    try:
        wait_until("series for every query", check, timeout=timeout)
    except AssertionError:
        empty = sorted(k for k, v in results.items() if not v)
        raise AssertionError(f"queries without data: {empty}") from None
    return results


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    # The router's panels read the router's series (no router in this stack): checked against the real
    # router's /metrics in tests/router/test_router_e2e.py. Likewise the scale-to-zero panels read the
    # activator's series (no activator here): its held/wake/refused series are read from a live
    # activator's /activator/metrics through whole wake cycles in tests/operator/test_op_activator.py.
    elsewhere = ROUTER_SERIES | activator_series_names()
    exprs = {
        f"{q.panel}/{q.ref}": substitute_grafana_vars(q.expr)
        for q in dashboard_queries()
        if not metric_names(substitute_grafana_vars(q.expr)) & elsewhere
    }
    results = _all_have_data(stack, exprs, timeout=120)
    # The per-model series carry the labels the dashboard variables select on.
    ttft = results["Time to first token/B"]
    assert {(s["metric"]["namespace"], s["metric"]["model_name"]) for s in ttft} == {(NAMESPACE, MODEL)}
    # The tokens/s panel reports real throughput of the load, not just a zero series: its graph over the
    # load, up to the first scrape after it, has a positive point. A 1m rate read at "now" was flaky on a
    # loaded machine both ways: 0 while no scrape had yet seen the load, and 0 again once the test got
    # here more than a minute after it. Over this range the first scrape after the load and an earlier
    # one (the fixture waits for a pre-load scrape) are within one rate window; a counter the load does
    # not move stays at 0 and fails here.
    seen = _first_scrape_after(
        stack, f'vllm:generation_tokens_total{{job="{DEPLOYMENT}"}}', stack.load_end, timeout=120
    )
    graph = _query_range(stack, exprs["Tokens / s/B"], stack.load_start - 1, seen + 1)
    assert graph and max(graph) > 0, graph
    ready = float(results["Replicas ready/A"][0]["value"][1])
    assert ready == 1.0


def test_dashboard_variables_list_the_namespace_and_model(stack: Stack) -> None:
    values = {}
    for var, selector in variable_selectors():
        match = substitute_grafana_vars(selector)
        r = httpx.get(f"{stack.prometheus_url}/api/v1/series", params={"match[]": match}, timeout=10)
        series = r.json()["data"]
        assert series, f"variable {var}: no series for {match}"
        values[var] = {s.get(var) for s in series}
    assert values == {"namespace": {NAMESPACE}, "model_name": {MODEL}}


def test_every_alert_is_loaded_and_its_quantity_has_data(stack: Stack) -> None:
    rules = load_alert_rules()
    exprs = {r.name: strip_threshold(r.expr) for r in rules}
    _all_have_data(stack, exprs, timeout=120)
    for rule in rules:
        _query(stack, rule.expr)  # the full alert expression evaluates (empty while not firing)

    def evaluated() -> bool:
        groups = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert set(loaded) == {r.name for r in rules}
        return all(r["health"] == "ok" and not r.get("lastError") for r in loaded.values())

    wait_until("every alert rule evaluated healthy", evaluated, timeout=120)


def test_promtool_checks_the_rules_prometheus_loaded() -> None:
    proc = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _exported_names(metrics_text: str) -> set[str]:
    names = set()
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


def test_dashboards_and_alerts_use_only_metrics_the_server_exports(stack: Stack) -> None:
    exported = _exported_names(httpx.get(f"{stack.server_url}/metrics", timeout=10).text)
    used: set[str] = set()
    for q in dashboard_queries():
        used |= metric_names(substitute_grafana_vars(q.expr))
    for _, selector in variable_selectors():
        used |= metric_names(substitute_grafana_vars(selector))
    for rule in load_alert_rules():
        used |= metric_names(rule.expr)
    activator = activator_series_names()
    unknown = used - exported - KSM_ALLOWED - ROUTER_SERIES - activator
    assert not unknown, f"not in the live /metrics: {sorted(unknown)}"
    # The allow-list stays honest: KSM names only, none the server could export instead.
    assert all(name.startswith("kube_") for name in KSM_ALLOWED)
    assert not (KSM_ALLOWED & exported)
    assert all(name.startswith("vllm_router_") for name in ROUTER_SERIES) and not (ROUTER_SERIES & exported)
    assert all(name.startswith("kubeinfer_activator_") for name in activator) and not (activator & exported)
