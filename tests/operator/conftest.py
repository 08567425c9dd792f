"""Fixtures for the operator integration tests: a kmock API server and the operator under KopfRunner."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kopf
import pytest
from kopf.testing import KopfRunner
from kubeinfer_operator import handlers
from kubernetes.config import kube_config
from op_cluster import BASE_RESOURCES, KEDA, MONITORING, MockCluster


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
    yield make
    for cluster in started:
        cluster.stop()


@pytest.fixture
def cluster(cluster_factory: Callable[..., MockCluster]) -> MockCluster:
    return cluster_factory()


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.watching.connect_timeout = 5
    # Each watch stream ends after 5 s (the emulator honours timeoutSeconds); the re-listing that
    # follows is the operator's periodic resync.
    settings.watching.server_timeout = 5
    settings.watching.client_timeout = 30
    settings.watching.reconnect_backoff = 0.05
    settings.queueing.exit_timeout = 1.0
    settings.queueing.idle_timeout = 1.0
    # The watched namespace is given exactly and the CRDs are fixed per test: no need to scan.
    settings.scanning.disabled = True
    return settings


@contextmanager
def run_operator() -> Iterator[KopfRunner]:
    args = ["run", "--standalone", "-n", "default", "-m", "kubeinfer_operator", "--verbose"]
    with KopfRunner(args, settings=operator_settings(), timeout=30) as runner:
        yield runner


@pytest.fixture
def operator(cluster: MockCluster) -> Iterator[Any]:
    with run_operator() as runner:
        yield runner
