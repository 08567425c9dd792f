"""spec.pod.annotations: what the API server refuses on the pod template is refused at admission, and
the API checks (the mock's) refuse it too. Found on kube-apiserver 1.36: a legacy
`seccomp.security.alpha.kubernetes.io/pod: unconfined` annotation passed admission and the API server
then refused the Deployment."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubeinfer_operator.__main__ import render_documents
from kubeinfer_operator.render import Capabilities
from kubeinfer_operator.spec import InvalidSpecError
from op_apichecks import api_errors
from op_testlib import inference_model


def _deployment(annotations: dict[str, str]) -> dict[str, Any]:
    doc = inference_model({"model": {"uri": "hf://org/model"}, "pod": {"annotations": annotations}}, name="m")
    doc["metadata"]["uid"] = "0c7d5e4a-1111-4222-8333-944445555666"
    (dep,) = [o for o in render_documents([doc], Capabilities()) if o["kind"] == "Deployment"]
    return dep


@pytest.mark.parametrize(
    "annotations",
    [
        {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"},
        {"seccomp.security.alpha.kubernetes.io/pod": "runtime/default"},
        {"container.seccomp.security.alpha.kubernetes.io/server": "unconfined"},
        {"container.apparmor.security.beta.kubernetes.io/sidecar": "runtime/default"},
        {"kubernetes.io/config.mirror": "x"},
        {"not a key": "x"},
        {"-bad/x": "y"},
        {f"example.com/k{i}": "v" * 4096 for i in range(64)},  # over 256 KiB in all
    ],
)
def test_refused_at_admission(annotations: dict[str, str]) -> None:
    with pytest.raises(InvalidSpecError):
        _deployment(annotations)


def test_accepted_annotations_reach_a_deployment_the_api_server_accepts() -> None:
    dep = _deployment(
        {
            "example.com/team": "search",
            "container.apparmor.security.beta.kubernetes.io/server": "runtime/default",
        }
    )
    assert api_errors(dep) == []
    assert dep["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "search"


def test_the_api_checks_refuse_what_the_api_server_refuses() -> None:
    """The mock's checks, written from pkg/apis/core/validation, refuse the two the real API server did."""
    dep = _deployment({})
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["metadata"].setdefault("annotations", {})[
        "seccomp.security.alpha.kubernetes.io/pod"
    ] = "unconfined"
    assert any("seccomp type in annotation and field must match" in e for e in api_errors(bad))
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["metadata"].setdefault("annotations", {})[
        "container.apparmor.security.beta.kubernetes.io/sidecar"
    ] = "runtime/default"
    assert any("container not found" in e for e in api_errors(bad))
