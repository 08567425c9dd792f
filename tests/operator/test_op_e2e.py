"""End-to-end against a real cluster (kind, k3d, minikube, ...): runs only when KUBECONFIG names a
reachable API server, and is skipped with the reason otherwise.

It installs the CRD, runs the operator in-process (namespaced to a fresh namespace), and checks what
only a real API server can show: the CRD's CEL rules reject a bad object, server-side apply and field
ownership work, owner references drive garbage collection, and the scale subresource works."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from op_testlib import CRD_PATH, inference_model

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = "kubeinfer.dev", "v1alpha1", "inferencemodels"


def _reachable_cluster() -> tuple[Any, str | None]:
    """(ApiClient, None) for a reachable cluster, else (None, why not)."""
    path = os.environ.get("KUBECONFIG")
    if not path:
        return None, "KUBECONFIG is not set: no cluster to run the e2e test against"
    if not all(os.path.exists(p) for p in path.split(os.pathsep)):
        return None, f"KUBECONFIG={path} does not exist"
    from kubernetes import client, config

    try:
        cfg = client.Configuration()
        config.load_kube_config(client_configuration=cfg)
        api = client.ApiClient(cfg)
        client.VersionApi(api).get_code(_request_timeout=3)
    except Exception as exc:  # any failure to reach the cluster means "skip", with the reason
        return None, f"cluster in KUBECONFIG={path} is not reachable: {type(exc).__name__}: {exc}"
    return api, None


@pytest.fixture(scope="module")
def api() -> Iterator[Any]:
    api_client, why = _reachable_cluster()
    if api_client is None:
        pytest.skip(why or "no cluster")
    yield api_client
    api_client.close()


@pytest.fixture(scope="module")
def namespace(api: Any) -> Iterator[str]:
    from kubernetes import client

    ext: Any = client.ApiextensionsV1Api(api)
    crd = yaml.safe_load(CRD_PATH.read_text())
    ext.patch_custom_resource_definition(
        crd["metadata"]["name"],
        crd,
        field_manager="kubeinfer-e2e",
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = ext.read_custom_resource_definition(crd["metadata"]["name"]).status
        conditions = (status.conditions if status is not None else None) or []
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            break
        time.sleep(1)
    name = f"kubeinfer-e2e-{uuid.uuid4().hex[:6]}"
    core: Any = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


def _wait(fn: Any, timeout: float = 90, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_operator_on_a_real_cluster(api: Any, namespace: str) -> None:
    from kopf.testing import KopfRunner
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    objects: Any = client.CustomObjectsApi(api)
    apps: Any = client.AppsV1Api(api)
    core: Any = client.CoreV1Api(api)

    # The API server enforces the CRD's CEL rules.
    bad = inference_model(
        {"model": {"uri": "hf://o/m"}, "scaling": {"autoscaler": "HPA"}}, name="bad", namespace=namespace
    )
    with pytest.raises(ApiException) as err:
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert err.value.status == 422 and "maxReplicas" in str(err.value.body)

    doc = inference_model(
        {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
            "resources": {"gpu": {"count": 0}, "memory": "2Gi"},
        },
        name="e2e",
        namespace=namespace,
    )
    with KopfRunner(["run", "--standalone", "-n", namespace, "-m", "kubeinfer_operator"], timeout=60):
        created = objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        uid = created["metadata"]["uid"]
        dep = _wait(
            lambda: _get(lambda: apps.read_namespaced_deployment("e2e", namespace)), what="Deployment"
        )
        assert dep.metadata.owner_references[0].uid == uid
        assert _get(lambda: core.read_namespaced_service("e2e", namespace)) is not None
        im = _wait(
            lambda: (
                (o := objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "e2e")).get(
                    "status"
                )
                and o
            ),
            what="status",
        )
        types = {c["type"] for c in im["status"]["conditions"]}
        assert types == {"Ready", "Progressing", "Degraded", "MonitoringAvailable"}
        # The scale subresource moves the Deployment.
        objects.patch_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, "e2e", {"spec": {"replicas": 2}}
        )
        _wait(
            lambda: apps.read_namespaced_deployment("e2e", namespace).spec.replicas == 2,
            what="scaled Deployment",
        )

    objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "e2e")
    _wait(
        lambda: _get(lambda: apps.read_namespaced_deployment("e2e", namespace)) is None,
        what="garbage collection",
    )


def _get(fn: Any) -> Any:
    from kubernetes.client.exceptions import ApiException

    try:
        return fn()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
