"""Fixtures for the operator integration tests: a kmock API server and the operator under KopfRunner."""

from __future__ import annotations

import os

# For operator subprocesses started by these tests; the in-process operator gets the fixture's patch.
os.environ.setdefault("KUBEINFER_RESYNC_SECONDS", "2")
# Every Secret reference needs the administrator's consent (issue 45 item 1): the Secrets these tests'
# models name, allowed as an administrator would (handlers.POLICY reads it at import).
os.environ.setdefault(
    "KUBEINFER_ALLOWED_SECRETS", "hf,hf-token,hub,s,a,api,k,keys,regcred,own,mirror-pull,operator-pull"
)
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubeinfer_operator import handlers
from kubeinfer_operator.admission import AdmissionPolicy
from kubernetes.config import kube_config
from op_cluster import BASE_RESOURCES, KEDA, MONITORING, MockCluster, run_operator


@pytest.fixture
def cluster_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., MockCluster]]:
    started: list[MockCluster] = []

    def make(monitoring: bool = True, keda: bool = True) -> MockCluster:
        resources = dict(BASE_RESOURCES)
        if monitoring:
            resources |= MONITORING
        if keda:
            resources |= KEDA
        cluster = MockCluster(resources=resources).start()
        started.append(cluster)
        kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
        # Both kopf's login and the operator's KubeClient read the default kubeconfig location.
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        return cluster

    # Fast retries so fault scenarios converge within a test's budget.
    monkeypatch.setattr(handlers, "RETRY_BASE_SECONDS", 0.2)
    monkeypatch.setattr(handlers, "RETRY_MAX_SECONDS", 1.0)
    monkeypatch.setattr(handlers, "REQUEST_TIMEOUT_SECONDS", 5.0)
    monkeypatch.setattr(handlers, "DISCOVERY_TTL_SECONDS", 1.0)
    # handlers reads KUBEINFER_RESYNC_SECONDS when first imported, and the package's __init__ imports it
    # (for `kopf run -m kubeinfer_operator`): in a full run tests/deploy imports kubeinfer_operator.render
    # before this conftest, fixing 60 s, and a child of a CRD installed mid-test came after the waits.
    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 2.0)
    # The same for the admission policy: read at that early import, it allowed no Secret at all, and
    # every model naming one stayed refused (CI's full run; a partition starting at tests/operator passed).
    monkeypatch.setattr(handlers, "POLICY", AdmissionPolicy.from_environment(os.environ))
    yield make
    for cluster in started:
        cluster.stop()
    # A field the CRD does not declare is lost on a real cluster: the operator (kopf and its own client)
    # must never write one; only a test's own urllib requests may, on purpose.
    for cluster in started:
        assert [p for p in cluster.server.pruned if p[0] != "Python-urllib"] == []


@pytest.fixture
def cluster(cluster_factory: Callable[..., MockCluster]) -> MockCluster:
    return cluster_factory()


@pytest.fixture
def operator(cluster: MockCluster) -> Iterator[Any]:
    with run_operator() as runner:
        yield runner
