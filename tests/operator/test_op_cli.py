"""`python -m kubeinfer_operator render` (no cluster) and the kopf entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kopf
import pytest
import yaml
from kmock_params import query_error
from kubeinfer_operator.__main__ import build_parser, main
from op_cluster import MockCluster, wait_for
from op_testlib import EXAMPLES, REPO, inference_model

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'operator'}"}


def test_render_cli_prints_every_object_as_yaml() -> None:
    autoscaled = REPO / "examples" / "autoscaled.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "kubeinfer_operator", "render", "-f", str(autoscaled)],
        capture_output=True,
        text=True,
        env=ENV,
        check=True,
        timeout=60,
    )
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs] == [
        "NetworkPolicy",  # first: the pods start fenced (netpol.py)
        "ServiceAccount",  # the pods' own, before them
        "Service",
        "PodDisruptionBudget",
        "Deployment",
        "ServiceMonitor",
        "ScaledObject",
    ]
    assert all(d["metadata"]["name"] == "mistral-7b" for d in docs)
    assert all("ownerReferences" not in d["metadata"] for d in docs)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_every_example(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(path)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = {d["kind"] for d in docs}
    # exactly one workload: a Deployment, or a LeaderWorkerSet for parallelism.nodes > 1
    assert "Service" in kinds and len(kinds & {"Deployment", "LeaderWorkerSet"}) == 1


def test_render_without_prometheus_operator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--no-service-monitor", "-f", str(EXAMPLES[0])]) == 0
    assert "ServiceMonitor" not in {d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)}


def test_render_rejects_an_invalid_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kubeinfer.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: x}\n"
        "spec: {model: {uri: 'hf://o/m'}, engine: {extraArgs: ['--host=1.2.3.4']}}\n"
    )
    assert main(["render", "-f", str(bad)]) == 1
    assert "--host" in capsys.readouterr().err
    bad.write_text(
        "apiVersion: kubeinfer.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: x}\nspec: {model: {uri: 'ftp://x'}}\n"
    )
    assert main(["render", "-f", str(bad)]) == 1


def test_run_options() -> None:
    args = build_parser().parse_args(
        ["run", "-A", "--peering", "kubeinfer", "--liveness", "http://0.0.0.0:9000/healthz"]
    )
    assert args.all_namespaces and args.peering == "kubeinfer" and args.liveness.endswith("/healthz")
    args = build_parser().parse_args(["run", "-n", "a", "-n", "b", "--standalone"])
    assert args.namespace == ["a", "b"] and args.standalone
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--peering", "x", "--standalone"])


def test_importing_the_package_registers_every_handler() -> None:
    # What `kopf run -m kubeinfer_operator` relies on: the import registers the handlers.
    import kubeinfer_operator  # noqa: F401

    registry = kopf.get_default_registry()
    changing = registry._changing.get_all_handlers()
    assert {h.id for h in changing} == {"reconcile_handler"}
    # create, update, and resume (registered as initial=True without a reason)
    assert {(str(h.reason.value) if h.reason else None, h.initial) for h in changing} == {
        ("create", None),
        ("update", None),
        (None, True),
    }
    for h in changing:
        assert h.selector is not None
        assert (h.selector.group, h.selector.any_name) == ("kubeinfer.dev", "inferencemodels")
        assert not h.requires_finalizer  # deletion is left to garbage collection
    watched = {
        (h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers() if h.selector
    }
    assert watched == {
        ("kubeinfer.dev", "inferencemodels"),  # the periodic resync
        ("apps", "deployments"),
        ("", "services"),
        ("policy", "poddisruptionbudgets"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("monitoring.coreos.com", "servicemonitors"),
        ("keda.sh", "scaledobjects"),
        ("batch", "jobs"),  # the shared cache's loader Jobs
        ("leaderworkerset.x-k8s.io", "leaderworkersets"),  # spec.parallelism.nodes > 1
        ("", "pods"),  # status reads the kubelet's reasons
        ("apiextensions.k8s.io", "customresourcedefinitions"),  # optional CRDs installed later
        # every other owned kind but the Secret (handlers.WATCHED_CHILD_KINDS): drift comes back at once
        ("", "configmaps"),
        ("", "persistentvolumeclaims"),
        ("", "serviceaccounts"),
        ("networking.k8s.io", "networkpolicies"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
    }
    assert registry._spawning.get_all_handlers() == []  # no timers/daemons: they would need finalizers
    activities = {h.id for h in registry._activities.get_all_handlers()}
    assert {"configure", "close", "login"} <= activities


def test_kopf_run_module_operates_a_cluster(cluster: MockCluster) -> None:
    # The real entry point in its own process: `kopf run -m kubeinfer_operator`, cluster-wide, logging
    # in through KUBECONFIG, with a liveness endpoint.
    env = {**ENV, "KUBECONFIG": os.environ["KUBECONFIG"]}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kopf",
            "run",
            "-A",
            "--standalone",
            "-m",
            "kubeinfer_operator",
            "--liveness",
            "http://127.0.0.1:0/healthz",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        cluster.create("InferenceModel", inference_model({"model": {"uri": "hf://o/m"}}, name="cli"))
        wait_for(lambda: cluster.get("Deployment", "cli"), timeout=60, what="Deployment from the kopf CLI")
        wait_for(
            lambda: (cluster.get("InferenceModel", "cli") or {}).get("status"), timeout=90, what="status"
        )
        # Every watch typed as the API server parses it (issue 29 F3: kopf's timeoutSeconds=60.0 got a
        # 400 from a real API server, every watcher failed and the operator exited).
        watches = wait_for(
            lambda: [r for r in list(cluster.server) if r.params.get("watch") == "true"], what="a watch"
        )
        assert [query_error(r.params) for r in watches] == [None] * len(watches)
        assert proc.poll() is None, "the operator exited"
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=90)
    assert "Activity 'configure' succeeded" in output
