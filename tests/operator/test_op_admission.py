"""Admission: every row of the table gets the same verdict and message from the CRD (schema + CEL, as
the API server applies them) and from `render` (the pydantic models); what is accepted renders
children that the API server accepts too (kubernetes-validate --strict plus the refusals kmock's
emulator makes like the API server: names, labels, strategy, quantities)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator.__main__ import render_documents
from kubeinfer_operator.names import child_name, is_dns1035_label
from kubeinfer_operator.render import Capabilities
from kubeinfer_operator.spec import InferenceModel, InvalidSpecError
from op_admission_table import ADMISSION, LONG_NAME, Row
from op_apichecks import GATEWAY_KINDS, api_errors, gateway_api_errors
from op_testlib import K8S_VERSIONS, crd_errors, inference_model

IDS = [r.id for r in ADMISSION]


def _doc(row: Row) -> dict[str, Any]:
    return inference_model(row.spec, name=row.name)


@pytest.mark.parametrize("row", ADMISSION, ids=IDS)
def test_crd_verdict(row: Row) -> None:
    errors = crd_errors(_doc(row))
    if row.refusal is None:
        assert errors == []
    else:
        assert any(row.refusal in e for e in errors), errors


@pytest.mark.parametrize("row", ADMISSION, ids=IDS)
def test_render_gives_the_same_verdict(row: Row) -> None:
    if row.refusal is None:
        render_documents([_doc(row)], Capabilities())
        return
    with pytest.raises(InvalidSpecError) as info:
        render_documents([_doc(row)], Capabilities())
    if any(schema in row.refusal for schema in ("in body should match", "too long", "Unsupported value")):
        return  # a schema pattern / length / enum: pydantic words it differently, the verdict is what counts
    assert row.refusal in str(info.value)


ACCEPTED = [r for r in ADMISSION if r.refusal is None]


@pytest.mark.parametrize("row", ACCEPTED, ids=[r.id for r in ACCEPTED])
def test_accepted_specs_render_children_the_api_server_accepts(row: Row) -> None:
    doc = _doc(row)
    doc["metadata"]["uid"] = "0c7d5e4a-1111-4222-8333-944445555666"
    for obj in render_documents([doc], Capabilities()):
        assert api_errors(obj) == [], obj["kind"]
        if obj["kind"] in GATEWAY_KINDS:
            assert gateway_api_errors(obj) == [], obj["kind"]
        elif obj["kind"] not in ("ServiceMonitor", "ScaledObject", "LeaderWorkerSet"):
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_the_api_checks_refuse_what_the_cluster_refuses() -> None:
    # Without derived names, the InferenceModel's own name would make an invalid Service.
    svc = {"kind": "Service", "metadata": {"name": "llama-3.1-8b"}, "spec": {}}
    assert api_errors(svc) and "DNS-1035" in api_errors(svc)[0]
    dep = {
        "kind": "Deployment",
        "metadata": {"name": "m"},
        "spec": {"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}},
    }
    assert any("may not be 0 when `maxSurge` is 0" in e for e in api_errors(dep))
    lab = {"kind": "Deployment", "metadata": {"name": "m", "labels": {"a": "x" * 64}}, "spec": {}}
    assert api_errors(lab)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "7b-chat", LONG_NAME, "Model", "a..b", "x" * 253])
def test_child_names_are_valid_and_distinct(name: str) -> None:
    derived = child_name(name)
    assert is_dns1035_label(derived)
    assert derived != child_name(name.replace(".", "-") + "x")
    assert child_name(derived) == derived  # a valid name is kept as it is


def test_names_that_differ_only_in_dots_get_different_children() -> None:
    assert child_name("llama-3.1-8b") != child_name("llama-3-1-8b")
    assert child_name("llama-3-1-8b") == "llama-3-1-8b"


def test_rendered_children_use_the_derived_name() -> None:
    im = InferenceModel.from_manifest(
        inference_model({"model": {"uri": "hf://org/model"}}, name="llama-3.1-8b")
    )
    objs = render_documents(
        [inference_model({"model": {"uri": "hf://org/model"}}, name="llama-3.1-8b")], Capabilities()
    )
    assert {o["metadata"]["name"] for o in objs} == {im.child_name}
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert (
        dep["spec"]["template"]["metadata"]["annotations"]["kubeinfer.dev/inference-model"] == "llama-3.1-8b"
    )
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_surge_zero_alone_gets_one_unavailable() -> None:
    objs = render_documents(
        [inference_model({"model": {"uri": "hf://o/m"}, "rollout": {"maxSurge": 0}})], Capabilities()
    )
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_quantities_are_compared_by_value() -> None:
    from kubeinfer_operator.render import is_subset
    from op_apichecks import canonical_quantity

    assert canonical_quantity("0.5") == "500m" and canonical_quantity("1.5Gi") == "1536Mi"
    desired = {"resources": {"requests": {"cpu": "0.5", "memory": "1.5Gi"}}}
    live = {"resources": {"requests": {"cpu": "500m", "memory": "1536Mi"}}}
    assert is_subset(desired, live)
    assert not is_subset(desired, {"resources": {"requests": {"cpu": "600m", "memory": "1536Mi"}}})
    assert not is_subset({"image": "0.5"}, {"image": "500m"})  # only quantity fields
