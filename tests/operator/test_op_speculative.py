"""engine.speculative in the InferenceModel (n-gram and draft-model forms) renders into the server's
--speculative-config, which the server's own parser accepts as the same settings."""

from __future__ import annotations

import json

import pytest
from kubeinfer_operator.render import render_deployment
from kubeinfer_operator.spec import InferenceModel, semantic_errors
from op_testlib import inference_model

from server.cli import build_parser, config_from_args
from server.spec_decode.config import SpeculativeConfig


def args_of(spec: dict) -> list[str]:
    doc = inference_model(spec, name="llm", namespace="ml")
    doc["metadata"]["uid"] = "6f1c8c0e-8a57-4a4c-9d6e-2f7f2b1f0a11"
    dep = render_deployment(InferenceModel.from_manifest(doc))
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_speculative_renders_into_the_flag_the_server_reads() -> None:
    spec = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3, "disableByBatchSize": 8}
    args = args_of({"model": {"uri": "hf://org/model"}, "engine": {"speculative": spec}})
    value = args[args.index("--speculative-config") + 1]
    assert json.loads(value) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 8,
    }
    server = config_from_args(build_parser({}).parse_args(["--speculative-config", value]))
    assert server.engine.speculative == SpeculativeConfig("ngram", 4, 3, 3, disable_by_batch_size=8)


def test_no_speculative_no_flag() -> None:
    assert "--speculative-config" not in args_of({"model": {"uri": "hf://org/model"}})


@pytest.mark.parametrize(
    ("model_uri", "draft_uri", "server_draft"),
    [
        ("hf://org/model", "hf://org/draft", "org/draft"),
        ("pvc://models/big", "pvc://models/small", "/models/models/small"),
        ("/opt/models/big", "/opt/models/small", "/opt/models/small"),
    ],
)
def test_draft_model_form_renders_into_the_flag_the_server_reads(
    model_uri: str, draft_uri: str, server_draft: str
) -> None:
    spec = {"method": "draft_model", "model": draft_uri, "numSpeculativeTokens": 4, "disableByBatchSize": 8}
    args = args_of({"model": {"uri": model_uri}, "engine": {"speculative": spec}})
    value = args[args.index("--speculative-config") + 1]
    assert json.loads(value) == {
        "method": "draft_model",
        "model": server_draft,
        "num_speculative_tokens": 4,
        "disable_by_batch_size": 8,
    }
    server = config_from_args(build_parser({}).parse_args(["--speculative-config", value]))
    assert server.engine.speculative == SpeculativeConfig(
        "draft_model", 4, model=server_draft, disable_by_batch_size=8
    )
    if model_uri.startswith("pvc://"):  # the draft is read from the model's mounted claim
        doc = inference_model({"model": {"uri": model_uri}}, name="llm", namespace="ml")
        pod = render_deployment(InferenceModel.from_manifest(doc))["spec"]["template"]["spec"]
        assert any(
            server_draft.startswith(m["mountPath"] + "/") for m in pod["containers"][0]["volumeMounts"]
        )


def test_pvc_draft_on_another_claim_is_refused() -> None:
    spec = {"method": "draft_model", "model": "pvc://other/small", "numSpeculativeTokens": 4}
    doc = inference_model({"model": {"uri": "pvc://models/big"}, "engine": {"speculative": spec}})
    errors = semantic_errors(InferenceModel.from_manifest(doc).spec)
    assert any("a pvc:// draft must live on the model's claim (models)" in e for e in errors)
