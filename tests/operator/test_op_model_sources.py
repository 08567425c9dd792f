"""Models from S3 and OCI images (issue 48 items 2 and 3): what the operator renders for them
(kubernetes-validate --strict), where the credentials go (the loader Job only), the loader's failure
reason as the cache's, the Secret allow-list, and an oci:// model on an API server without
image volumes (kmock reports 1.26): Degraded with a clear reason and nothing applied, then deployed
once the server has them."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator import cache as model_cache
from kubeinfer_operator.admission import AdmissionPolicy
from kubeinfer_operator.defaults import ClusterDefaults
from kubeinfer_operator.k8s import KubeClient, parse_version
from kubeinfer_operator.policy import model_policy_errors
from kubeinfer_operator.render import render_all
from kubeinfer_operator.spec import InferenceModel, InvalidSpecError
from op_apichecks import api_errors
from op_cluster import MockCluster, condition, wait_for
from op_testlib import K8S_VERSIONS, crd_errors, inference_model

UID = "0c7d5e4a-1111-4222-8333-944445555666"
S3_SPEC = {
    "model": {"uri": "s3://models/llama/v1", "credentialsSecretRef": {"name": "s3-creds"}},
    "cache": {"mode": "Shared", "size": "20Gi"},
}
OCI_TAG = "oci://registry.example.com/models/llama:v1"


def model(doc_spec: dict[str, Any], name: str = "llm") -> InferenceModel:
    doc = inference_model(doc_spec, name=name)
    doc["metadata"]["uid"] = UID
    return InferenceModel.from_manifest(doc)


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def _env_names(container: dict[str, Any]) -> set[str]:
    return {e["name"] for e in container.get("env") or []}


def test_s3_model_credentials_reach_the_loader_only() -> None:
    im = model(S3_SPEC)
    objs = by_kind(render_all(im, cache_ready=True).objects)
    job, dep = objs["Job"], objs["Deployment"]
    for obj in (job, dep):
        assert api_errors(obj) == []
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    (loader,) = job["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in loader["env"] if "valueFrom" in e}
    assert refs == {
        "AWS_ACCESS_KEY_ID": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"},
        "AWS_ENDPOINT_URL": {"name": "s3-creds", "key": "AWS_ENDPOINT_URL", "optional": True},
        "AWS_REGION": {"name": "s3-creds", "key": "AWS_REGION", "optional": True},
    }
    folder = "/var/cache/kubeinfer/models/s3--models--llama--v1"
    assert loader["args"][:2] == ["--model", "s3://models/llama/v1"] and folder in loader["args"]
    assert "--revision" not in loader["args"]
    (server,) = dep["spec"]["template"]["spec"]["containers"]
    assert not {n for n in _env_names(server) if n.startswith("AWS_") or n == "HF_TOKEN"}
    assert "s3-creds" not in str(dep)  # no env, volume or envFrom names the Secret
    args = server["args"]
    assert args[args.index("--model") + 1] == "/var/cache/kubeinfer-shared/models/s3--models--llama--v1"
    assert args[args.index("--served-model-name") + 1] == "v1"


def test_egress_to_the_store_only_for_s3_models() -> None:
    """The loader carries the model's labels, so the model's NetworkPolicy decides where it connects:
    HTTPS for an s3:// store; an oci:// model (the kubelet pulls it) gets no internet egress."""

    def egress_ports(im: InferenceModel) -> list[Any]:
        policy = next(o for o in render_all(im, cache_ready=True).objects if o["kind"] == "NetworkPolicy")
        return [rule.get("ports") for rule in policy["spec"]["egress"]]

    assert [{"protocol": "TCP", "port": 443}] in egress_ports(model(S3_SPEC))
    assert [{"protocol": "TCP", "port": 443}] not in egress_ports(model({"model": {"uri": OCI_TAG}}))


def test_a_long_s3_prefix_keeps_a_valid_folder_name() -> None:
    long_uri = "s3://models/" + "/".join(["segment-" + "x" * 40] * 8)
    im = model({**S3_SPEC, "model": {"uri": long_uri}})
    key = model_cache.model_key(im)
    assert len(key) <= 200 and key.startswith("s3--models--segment-")
    other = model({**S3_SPEC, "model": {"uri": long_uri + "y"}})
    assert model_cache.model_key(other) != key


def _failed_loader(message: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = {
        "status": {
            "conditions": [
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "backoff"}
            ]
        }
    }
    pod = {
        "status": {
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {
                            "exitCode": 1,
                            "finishedAt": "2026-12-04T10:00:00Z",
                            "message": message,
                        }
                    }
                }
            ]
        }
    }
    return job, [pod]


def test_the_loaders_reason_is_the_caches_reason() -> None:
    im = model(S3_SPEC)
    claim = {"spec": {"accessModes": ["ReadWriteMany"]}}
    words = (
        "2026-12-04 10:00:00 model s3://models/llama/v1: downloading\n"
        "download failed: CredentialsRejected: SignatureDoesNotMatch: The request signature we calculated "
        "does not match the signature you provided."
    )
    state = model_cache.judge(im, claim, *_failed_loader(words))
    assert state.phase == "Failed" and state.reason == "CredentialsRejected"
    assert "SignatureDoesNotMatch" in state.message
    # While the Job still retries, the message already says why the last attempt failed.
    retrying = model_cache.judge(im, claim, {"status": {"failed": 1}}, _failed_loader(words)[1])
    assert retrying.phase == "Loading" and "attempt 2 of 5" in retrying.message
    assert (
        "; last attempt: " in retrying.message
        and "CredentialsRejected: SignatureDoesNotMatch" in retrying.message
    )
    # A loader that printed no reason (an older image, a crash): the Job's own.
    state = model_cache.judge(im, claim, *_failed_loader("Traceback ... MemoryError"))
    assert state.reason == "BackoffLimitExceeded"


def test_the_s3_secret_goes_through_the_administrators_allow_list() -> None:
    defaults = ClusterDefaults()
    (e,) = model_policy_errors(model(S3_SPEC), AdmissionPolicy(), defaults)
    assert "s3-creds" in e and "admission.allowedSecrets" in e
    assert model_policy_errors(model(S3_SPEC), AdmissionPolicy(allowed_secrets=("s3-creds",)), defaults) == []
    # An oci:// model is data, like an hf:// repo (neither is allow-listed): mounted read-only and noexec,
    # loaded as safetensors/GGUF with remote code refused; admission.allowedImages governs what runs.
    assert model_policy_errors(model({"model": {"uri": OCI_TAG}}), AdmissionPolicy(), defaults) == []


@pytest.mark.parametrize(
    ("uri", "policy"),
    [(OCI_TAG, "Always"), (f"oci://ghcr.io/org/llama@sha256:{'b' * 64}", "IfNotPresent")],
)
def test_oci_model_is_a_read_only_image_volume(uri: str, policy: str) -> None:
    im = model({"model": {"uri": uri}})
    dep = by_kind(render_all(im).objects)["Deployment"]
    assert api_errors(dep) == []
    kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
    pod = dep["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume == {
        "name": "model",
        "image": {"reference": uri.removeprefix("oci://"), "pullPolicy": policy},
    }
    (server,) = pod["containers"]
    assert {"name": "model", "mountPath": "/models/oci", "readOnly": True} in server["volumeMounts"]
    args = server["args"]
    assert args[args.index("--model") + 1] == "/models/oci"
    assert args[args.index("--served-model-name") + 1] == "llama"
    # Kubernetes 1.30 has no image volumes at all (why the operator checks the server's version).
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


def test_a_secret_of_another_namespace_is_refused() -> None:
    """credentialsSecretRef has no namespace: a Secret is read in the model's own namespace only. The
    CRD refuses the field (kubectl's strict field validation; pruned by a lax client) and so does
    render, each in its words."""
    doc = inference_model(
        {
            **S3_SPEC,
            "model": {**S3_SPEC["model"], "credentialsSecretRef": {"name": "s3-creds", "namespace": "other"}},
        }
    )
    assert any("'namespace' was unexpected" in e for e in crd_errors(doc))
    with pytest.raises(InvalidSpecError, match="namespace"):
        InferenceModel.from_manifest(doc)


def test_parse_version() -> None:
    assert parse_version({"major": "1", "minor": "36"}) == (1, 36)
    assert parse_version({"major": "1", "minor": "31+"}) == (1, 31)
    assert parse_version({"gitVersion": "v1.36.0"}) is None


def test_oci_model_without_image_volumes_is_degraded_until_the_server_has_them(
    cluster: MockCluster, operator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kmock answers /version as Kubernetes 1.26: no image volumes.
    cluster.create("InferenceModel", inference_model({"model": {"uri": OCI_TAG}}, name="llm"))

    def degraded() -> dict[str, Any] | None:
        found = condition(cluster.get("InferenceModel", "llm"), "Degraded")
        return found if found and found.get("reason") == "ImageVolumeUnsupported" else None

    found = wait_for(degraded, what="Degraded ImageVolumeUnsupported")
    assert found["status"] == "True" and "1.26" in found["message"] and "1.35" in found["message"]
    assert cluster.get("Deployment", "llm") is None

    # The control plane upgraded: the next reconcile (here a spec edit) deploys the image volume.
    monkeypatch.setattr(KubeClient, "server_version", lambda self: (1, 36))
    cluster.patch("InferenceModel", "llm", {"spec": {"model": {"uri": OCI_TAG, "servedName": "llama-v1"}}})
    dep = wait_for(lambda: cluster.get("Deployment", "llm"), what="the Deployment")
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "image": {"reference": OCI_TAG.removeprefix("oci://"), "pullPolicy": "Always"},
    } in volumes
    wait_for(lambda: not degraded(), what="the ImageVolumeUnsupported condition cleared")
