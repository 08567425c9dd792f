"""The operator's exit status when kopf stops on its own (issue 29 F3, follow-up).

On a real kube-apiserver v1.36.2 every watch of main's operator got `400 strconv.ParseInt: parsing "60.0":
invalid syntax`, every watcher failed, kopf stopped and the process exited with status 0 (seen twice):
an operator that cannot reconcile must exit non-zero, so the kubelet's restarts and `kubectl get pods`
(Error, CrashLoopBackOff) say it failed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kmock import KubernetesError
from op_cluster import MockCluster
from op_testlib import REPO

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'operator'}"}
# The real server's answer (FINDINGS.md, F3), verbatim.
REFUSAL = KubernetesError(
    status=400, reason="BadRequest", message='strconv.ParseInt: parsing "60.0": invalid syntax'
)


@pytest.mark.parametrize(
    "flags",
    [
        ["--standalone"],
        # as the chart runs it: kopf only once the Lease is held
        ["--leader-elect", "--leader-elect-resource-namespace=default", "--leader-elect-retry-period=200ms"],
    ],
    ids=["standalone", "leader-elect"],
)
def test_an_operator_whose_watchers_fail_exits_non_zero(cluster: MockCluster, flags: list[str]) -> None:
    cluster.server.refused_watch = REFUSAL
    env = {**ENV, "KUBECONFIG": os.environ["KUBECONFIG"]}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kubeinfer_operator", "run", "-A", "--liveness", "", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "strconv.ParseInt" in proc.stdout + proc.stderr  # it did meet the refusal
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
