"""The cluster administrator's admission policy (chart values admission.* -> the operator's
environment -> checked at reconcile time): other images, ServiceAccounts and Secret references are
refused unless allowed, with a condition that names the chart value. The unconditional refusals
(restricted Pod Security Standard, loader variables, refused flags) are rows of op_admission_table."""

from __future__ import annotations

from typing import Any

import pytest
from kubeinfer_operator import handlers
from kubeinfer_operator.admission import AdmissionPolicy, pod_secret_names
from kubeinfer_operator.defaults import ClusterDefaults
from kubeinfer_operator.policy import SECRET_REF_FIELDS, model_policy_errors, model_secret_names
from kubeinfer_operator.render import render_deployment
from kubeinfer_operator.spec import InferenceModel
from op_admission_table import ADMISSION
from op_cluster import MockCluster, condition, wait_for
from op_testlib import crd_schema, inference_model
from pod_security import RULES

HF = {"uri": "hf://org/model"}
DEFAULTS = ClusterDefaults()
SECRET_ENV = {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "db-pass", "key": "k"}}}
SECRET_VOLUME = {"name": "s", "secret": {"secretName": "tls"}}
PROJECTED = {"name": "p", "projected": {"sources": [{"secret": {"name": "cloud-creds"}}]}}
SECRET_ENV_FROM = {"secretRef": {"name": "all-keys"}, "prefix": "APP_"}


def errors(spec: dict[str, Any], policy: AdmissionPolicy | None = None) -> list[str]:
    im = InferenceModel.from_manifest(inference_model({"model": HF, **spec}))
    return model_policy_errors(im, policy or AdmissionPolicy(), DEFAULTS)


def test_default_policy_allows_the_installations_images_only() -> None:
    assert errors({}) == []
    assert errors({"engine": {"image": DEFAULTS.server_image}}) == []
    (e,) = errors({"engine": {"image": "attacker.example/miner:1"}})
    assert "'attacker.example/miner:1' is not allowed" in e and "admission.allowedImages" in e
    routed = {"routing": {"enabled": True, "image": "attacker.example/router:1"}}
    assert "admission.allowedImages" in errors(routed)[0]
    allow = AdmissionPolicy(allowed_images=("registry.example.com/llm/",))
    assert errors({"engine": {"image": "registry.example.com/llm/server:2"}}, allow) == []
    assert errors({"engine": {"image": "registry.example.com/other:2"}}, allow) != []


def test_service_accounts_need_the_administrators_consent() -> None:
    (e,) = errors({"pod": {"serviceAccountName": "cluster-admin-sa"}})
    assert "'cluster-admin-sa' is not allowed" in e and "admission.allowedServiceAccounts" in e
    assert (
        errors(
            {"pod": {"serviceAccountName": "reader"}}, AdmissionPolicy(allowed_service_accounts=("reader",))
        )
        == []
    )
    assert (
        errors({"pod": {"serviceAccountName": "x"}}, AdmissionPolicy(allowed_service_accounts=("*",))) == []
    )


def test_secret_references_in_the_pod_need_the_administrators_consent() -> None:
    pod = {"env": [SECRET_ENV], "envFrom": [SECRET_ENV_FROM], "volumes": [SECRET_VOLUME, PROJECTED]}
    (e,) = errors({"pod": pod})
    assert "db-pass, all-keys, tls, cloud-creds" in e and "admission.allowedSecrets" in e
    partly = AdmissionPolicy(allowed_secrets=("db-pass", "tls"))
    assert "all-keys, cloud-creds" in errors({"pod": pod}, partly)[0]
    assert errors({"pod": pod}, AdmissionPolicy(allowed_secrets=("*",))) == []
    assert pod_secret_names([], [], []) == []


# One spec per place a Secret can be named (policy.SECRET_REF_FIELDS), each naming Secret "leak".
LEAK = {"name": "leak", "key": "password"}
SECRET_PLACES: dict[str, dict[str, Any]] = {
    "spec.model.credentialsSecretRef": {"model": {**HF, "credentialsSecretRef": LEAK}},
    # a canary's hub token is the same kind of designated Secret (issue 48 item 4)
    "spec.canary.model.credentialsSecretRef": {
        "canary": {"model": {"uri": "hf://org/model-v2", "credentialsSecretRef": LEAK}, "weight": 10},
        "routing": {"gateway": {"enabled": True, "gatewayRef": {"name": "gw"}}},
    },
    "spec.adapters[].credentialsSecretRef": {
        "model": {**HF, "credentialsSecretRef": LEAK},
        "adapters": [{"name": "a", "uri": "hf://org/lora", "credentialsSecretRef": LEAK}],
    },
    "spec.engine.apiKeySecretRef": {"engine": {"apiKeySecretRef": LEAK}},
    "spec.pod.imagePullSecrets": {"pod": {"imagePullSecrets": [{"name": "leak"}]}},
    "spec.pod.env[].valueFrom.secretKeyRef": {
        "pod": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": LEAK}}]}
    },
    "spec.pod.envFrom[].secretRef": {"pod": {"envFrom": [{"secretRef": {"name": "leak"}, "prefix": "APP_"}]}},
    "spec.pod.volumes[].secret": {"pod": {"volumes": [{"name": "s", "secret": {"secretName": "leak"}}]}},
    "spec.pod.volumes[].projected.sources[].secret": {
        "pod": {"volumes": [{"name": "p", "projected": {"sources": [{"secret": {"name": "leak"}}]}}]}
    },
}


def _crd_secret_fields() -> set[str]:
    """Paths of the CRD's declared fields whose name says Secret."""
    found: set[str] = set()

    def walk(node: dict[str, Any], path: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            if "secret" in key.lower():
                found.add(f"{path}.{key}")
            walk(sub, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(crd_schema()["properties"]["spec"], "spec")
    return found


def test_every_secret_reference_of_the_spec_goes_through_the_secret_policy() -> None:
    """Issue 45 item 1: `model.credentialsSecretRef: {name: prod-db}` (any Secret of the namespace) was
    allowed, and the pods sent it as a bearer token to the hub; every place counts now, and a new CRD
    field naming a Secret fails here until SECRET_REF_FIELDS has it."""
    assert _crd_secret_fields() <= set(SECRET_REF_FIELDS), _crd_secret_fields() - set(SECRET_REF_FIELDS)
    assert set(SECRET_PLACES) == set(SECRET_REF_FIELDS)
    for place, spec in SECRET_PLACES.items():
        im = InferenceModel.from_manifest(inference_model({"model": HF, **spec}))
        assert model_secret_names(im) == ["leak"], place
        (e,) = model_policy_errors(im, AdmissionPolicy(), DEFAULTS)
        assert "Secret(s) leak" in e and "admission.allowedSecrets" in e, place
        assert model_policy_errors(im, AdmissionPolicy(allowed_secrets=("leak",)), DEFAULTS) == [], place


def test_policy_from_the_operators_environment() -> None:
    policy = AdmissionPolicy.from_environment(
        {
            "KUBEINFER_ALLOWED_IMAGES": "a.example/, b.example/x",
            "KUBEINFER_ALLOWED_SERVICE_ACCOUNTS": "reader",
            "KUBEINFER_ALLOWED_SECRETS": "*",
        }
    )
    assert policy == AdmissionPolicy(("a.example/", "b.example/x"), ("reader",), ("*",))
    assert AdmissionPolicy.from_environment({}) == AdmissionPolicy()


ACCEPTED = [r for r in ADMISSION if r.refusal is None]


@pytest.mark.parametrize("row", ACCEPTED, ids=[r.id for r in ACCEPTED])
def test_every_admitted_spec_renders_a_restricted_pod(row: Any) -> None:
    """Whatever admission lets through renders a pod inside the restricted standard."""
    dep = render_deployment(InferenceModel.from_manifest(inference_model(row.spec, name=row.name)))
    pod = {**dep["spec"]["template"]["spec"], "metadata": dep["spec"]["template"]["metadata"]}
    for rule, check in RULES.items():
        assert check(pod) == [], rule


def test_a_refused_model_gets_a_condition_and_no_pods(
    cluster: MockCluster, operator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handlers, "POLICY", AdmissionPolicy())
    spec = {"model": HF, "pod": {"serviceAccountName": "cluster-admin-sa"}}
    cluster.create("InferenceModel", inference_model(spec, name="llm"))
    degraded = wait_for(lambda: condition(cluster.get("InferenceModel", "llm"), "Degraded"), what="Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "admission.allowedServiceAccounts" in degraded["message"]
    assert cluster.get("Deployment", "llm") is None
    # the administrator allows it: the model deploys
    monkeypatch.setattr(handlers, "POLICY", AdmissionPolicy(allowed_service_accounts=("cluster-admin-sa",)))
    cluster.patch("InferenceModel", "llm", {"spec": {"pod": {"labels": {"retry": "1"}}}})
    dep = wait_for(lambda: cluster.get("Deployment", "llm"), what="Deployment once allowed")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "cluster-admin-sa"


def test_scheduling_onto_the_control_plane_needs_the_administrators_consent() -> None:
    """Issue 45 (scheduling fields): system priority classes, tolerate-all tolerations and control-plane
    node selectors / tolerations / affinity were accepted."""
    cp = "node-role.kubernetes.io/control-plane"
    refused = {
        "system-priority": {"priorityClassName": "system-node-critical"},
        "cluster-critical": {"priorityClassName": "system-cluster-critical"},
        "tolerate-all": {"tolerations": [{"operator": "Exists"}]},
        "selector": {"nodeSelector": {cp: ""}},
        "toleration": {"tolerations": [{"key": cp, "operator": "Exists", "effect": "NoSchedule"}]},
        "affinity": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": cp, "operator": "Exists"}]}]
                    }
                }
            }
        },
    }
    for case, scheduling in refused.items():
        (e,) = errors({"scheduling": scheduling})
        assert "admission.allow" in e, case
    assert "admission.allowedPriorityClasses" in errors({"scheduling": refused["system-priority"]})[0]
    allow = AdmissionPolicy(
        allowed_priority_classes=("system-node-critical", "system-cluster-critical"),
        allow_control_plane_scheduling=True,
    )
    assert all(errors({"scheduling": s}, allow) == [] for s in refused.values())
    # what stays allowed by default: other priority classes, keyed tolerations, keeping off the control plane
    off = {"nodeSelectorTerms": [{"matchExpressions": [{"key": cp, "operator": "DoesNotExist"}]}]}
    ok = {
        "priorityClassName": "high-priority",
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"gpu": "h100"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": off}},
    }
    assert errors({"scheduling": ok}) == []
    env = {
        "KUBEINFER_ALLOWED_PRIORITY_CLASSES": "system-node-critical",
        "KUBEINFER_ALLOW_CONTROL_PLANE_SCHEDULING": "true",
    }
    policy = AdmissionPolicy.from_environment(env)
    assert (
        policy.allowed_priority_classes == ("system-node-critical",) and policy.allow_control_plane_scheduling
    )


def test_credential_volumes_need_the_administrators_consent() -> None:
    """Issue 45 item 3: an inline secrets-store csi volume and a projected service-account token (any
    audience) were accepted past the Secret policy and automountServiceAccountToken: false."""
    csi = {"name": "vault", "csi": {"driver": "secrets-store.csi.k8s.io", "volumeAttributes": {"x": "y"}}}
    token = {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 3600, "path": "t"}}
    api_token = {"serviceAccountToken": {"path": "t"}}
    for volume, value in (
        (csi, "admission.allowedCSIDrivers"),
        ({"name": "t", "projected": {"sources": [token]}}, "admission.allowedTokenAudiences"),
        ({"name": "t", "projected": {"sources": [api_token]}}, "admission.allowedTokenAudiences"),
    ):
        (e,) = errors({"pod": {"volumes": [volume]}})
        assert value in e, e
    allow = AdmissionPolicy(
        allowed_csi_drivers=("secrets-store.csi.k8s.io",), allowed_token_audiences=("vault",)
    )
    assert errors({"pod": {"volumes": [csi, {"name": "t", "projected": {"sources": [token]}}]}}, allow) == []
    assert errors({"pod": {"volumes": [{"name": "t", "projected": {"sources": [api_token]}}]}}, allow) != []
    policy = AdmissionPolicy.from_environment(
        {"KUBEINFER_ALLOWED_CSI_DRIVERS": "a,b", "KUBEINFER_ALLOWED_TOKEN_AUDIENCES": "vault"}
    )
    assert policy.allowed_csi_drivers == ("a", "b") and policy.allowed_token_audiences == ("vault",)
