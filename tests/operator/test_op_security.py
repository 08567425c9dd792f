"""The rendered server pod meets the Kubernetes "restricted" Pod Security Standard, rule by rule
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, baseline + restricted controls).

The rules (tests/pod_security.py) are functions that return the violations they find; every rule is
also shown to fire on a pod that breaks it, so a passing test means the rule was really checked."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubeinfer_operator.render import ChildRef, render_all, render_deployment
from kubeinfer_operator.spec import InferenceModel
from op_testlib import EXAMPLES, inference_model, load_yaml
from pod_security import RULES, Pod


def _spec_variants() -> list[Any]:
    specs: dict[str, dict[str, Any]] = {
        "minimal": {"model": {"uri": "hf://org/m"}},
        "pvc-cache-secrets": {
            "model": {"uri": "pvc://w/m", "credentialsSecretRef": {"name": "s", "key": "k"}},
            "engine": {"apiKeySecretRef": {"name": "a", "key": "b"}},
            "cache": {"claimName": "c"},
            "scaling": {"replicas": 2},
        },
        "cpu": {"model": {"uri": "/opt/m"}, "resources": {"gpu": {"count": 0}}},
    }
    docs = [pytest.param(inference_model(s), id=k) for k, s in specs.items()]
    docs += [pytest.param(load_yaml(p), id=p.stem) for p in EXAMPLES]
    return docs


def pod_of(doc: dict[str, Any]) -> Pod:
    dep = render_deployment(InferenceModel.from_manifest(doc))
    pod = copy.deepcopy(dep["spec"]["template"]["spec"])
    pod["metadata"] = dep["spec"]["template"]["metadata"]
    return pod


@pytest.mark.parametrize("doc", _spec_variants())
@pytest.mark.parametrize("rule", list(RULES), ids=list(RULES))
def test_server_pod_meets_restricted(rule: str, doc: dict[str, Any]) -> None:
    assert RULES[rule](pod_of(doc)) == []


def _break(pod: Pod, rule: str) -> None:
    c = pod["containers"][0]
    sc = c["securityContext"]
    match rule:
        case "HostProcess":
            sc["windowsOptions"] = {"hostProcess": True}
        case "Host Namespaces":
            pod["hostPID"] = True
        case "Privileged Containers":
            sc["privileged"] = True
        case "HostPath Volumes":
            pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
        case "Host Ports":
            c["ports"][0]["hostPort"] = 8080
        case "AppArmor":
            sc["appArmorProfile"] = {"type": "Unconfined"}
        case "SELinux":
            sc["seLinuxOptions"] = {"type": "spc_t"}
        case "/proc Mount Type":
            sc["procMount"] = "Unmasked"
        case "Sysctls":
            pod["securityContext"]["sysctls"] = [{"name": "kernel.msgmax", "value": "1"}]
        case "Volume Types":
            pod["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}})
        case "Privilege Escalation":
            del sc["allowPrivilegeEscalation"]
        case "Running as Non-root":
            sc["runAsNonRoot"] = False
        case "Running as Non-root user":
            sc["runAsUser"] = 0
        case "Seccomp":
            sc["seccompProfile"] = {"type": "Unconfined"}
        case "Capabilities":
            sc["capabilities"] = {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
        case _:
            raise AssertionError(rule)


@pytest.mark.parametrize("rule", list(RULES), ids=list(RULES))
def test_each_rule_fires_on_a_violating_pod(rule: str) -> None:
    pod = pod_of(inference_model({"model": {"uri": "hf://org/m"}}))
    _break(pod, rule)
    assert RULES[rule](pod) != []


def test_read_only_root_with_writable_tmp_and_cache() -> None:
    pod = pod_of(inference_model({"model": {"uri": "hf://org/m"}}))
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/var/cache/kubeinfer"):
        assert path in mounts and not mounts[path].get("readOnly")
        assert (
            "emptyDir" in volumes[mounts[path]["name"]]
            or "persistentVolumeClaim" in volumes[mounts[path]["name"]]
        )
    env = {e["name"]: e.get("value") for e in c["env"]}
    # Everything the server or its libraries write goes to a mounted volume.
    assert env["HOME"] == "/tmp" and env["HF_HOME"].startswith("/var/cache/kubeinfer")
    assert pod["automountServiceAccountToken"] is False


def test_model_pods_run_as_their_own_service_account() -> None:
    """Issue 45 item 5: the pods ran as the namespace's `default` ServiceAccount, to which others may
    bind roles; now as one the operator creates per model (no token), unless the administrator allowed
    pod.serviceAccountName, whose pods run as that one and the model's own goes."""
    shared = {"mode": "Shared", "size": "20Gi", "storageClassName": "nfs"}
    doc = inference_model({"model": {"uri": "hf://org/model"}, "cache": shared}, name="llm")
    plan = render_all(InferenceModel.from_manifest(doc))
    (sa,) = [o for o in plan.objects if o["kind"] == "ServiceAccount"]
    assert sa["metadata"]["name"] == "llm" and sa["automountServiceAccountToken"] is False
    kinds = [o["kind"] for o in plan.objects]
    pods = [o for o in plan.objects if o["kind"] in ("Deployment", "Job")]
    assert {o["kind"] for o in pods} == {"Deployment", "Job"}
    for o in pods:
        assert kinds.index("ServiceAccount") < kinds.index(o["kind"])  # exists before its pods
        assert o["spec"]["template"]["spec"]["serviceAccountName"] == "llm", o["kind"]
    doc = inference_model(
        {"model": {"uri": "hf://org/model"}, "pod": {"serviceAccountName": "reader"}}, name="llm"
    )
    plan = render_all(InferenceModel.from_manifest(doc))
    assert not [o for o in plan.objects if o["kind"] == "ServiceAccount"]
    assert ChildRef("ServiceAccount", "llm") in plan.absent
    (dep,) = [o for o in plan.objects if o["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "reader"
