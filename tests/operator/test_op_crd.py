"""The CRD: valid for the API server, structural and documented, the examples pass its schema, invalid
specs fail it (every CEL rule exercised as the API server evaluates it, tests/crd_cel.py), and the pydantic models agree with it."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator.spec import (
    DEFAULT_SERVER_IMAGE,
    InferenceModel,
    InferenceModelSpec,
    InferenceModelStatus,
    InvalidSpecError,
)
from op_admission_table import ADMISSION
from op_testlib import (
    EXAMPLES,
    K8S_VERSIONS,
    cel_rules,
    crd_errors,
    crd_schema,
    evaluate_cel,
    inference_model,
    load_crd,
    load_yaml,
)
from pydantic import BaseModel

HF = {"uri": "hf://org/model"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_is_a_valid_customresourcedefinition(version: str) -> None:
    kubernetes_validate.validate(load_crd(), version, strict=True)


def test_crd_names_and_subresources() -> None:
    crd = load_crd()["spec"]
    assert crd["group"] == "kubeinfer.dev"
    assert crd["names"]["kind"] == "InferenceModel"
    assert crd["names"]["plural"] == "inferencemodels"
    assert crd["names"]["shortNames"]
    (version,) = crd["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.scaling.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Ready", "Replicas", "Model", "Quantization", "Adapters", "Endpoint", "Age"]
    adapters = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Adapters")
    assert adapters["jsonPath"] == ".status.adapterCount" and adapters["type"] == "integer"


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, sub in (node.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural_and_every_field_is_described() -> None:
    for path, node in _walk(crd_schema()):
        if path == "metadata" or path.endswith("[]") or path.endswith("{}"):
            continue
        assert node.get("description"), f"{path or '<root>'} has no description"
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_and_the_models(path: Any) -> None:
    doc = load_yaml(path)
    assert crd_errors(doc) == []
    InferenceModel.from_manifest(doc)


def test_examples_cover_minimal_awq_and_autoscaled() -> None:
    specs = {p.name: load_yaml(p)["spec"] for p in EXAMPLES}
    assert any(set(s) == {"model"} for s in specs.values())
    assert any(s.get("engine", {}).get("quantization") == "awq" for s in specs.values())
    assert any(s.get("scaling", {}).get("autoscaler") in ("HPA", "KEDA") for s in specs.values())


# (spec, the rejection message the API server and the models must give; None = accepted)
CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("minimal", {"model": HF}, None),
    ("pvc", {"model": {"uri": "pvc://models/llama/8b"}}, None),
    ("image-path", {"model": {"uri": "/opt/models/tiny"}}, None),
    ("cpu-only", {"model": HF, "resources": {"gpu": {"count": 0}}}, None),
    ("unknown-field", {"model": HF, "replicas": 2}, "Additional properties"),
    (
        "bad-enum",
        {"model": HF, "engine": {"quantization": "q4_k_m"}},
        'spec.engine.quantization: Unsupported value: "q4_k_m": supported values: "awq", "gptq", ',
    ),
    ("negative-replicas", {"model": HF, "scaling": {"replicas": -1}}, "minimum"),
    ("zero-target", {"model": HF, "scaling": {"target": 0}}, "less than or equal to the minimum"),
    ("no-uri", {"model": {}}, "'uri' is a required property"),
    (
        "scheme",
        {"model": {"uri": "http://bucket/model"}},
        "must start with hf://, pvc://, s3://, oci:// or /",
    ),
    ("hf-format", {"model": {"uri": "hf://just-a-name"}}, "hf:// must look like hf://org/name"),
    ("pvc-format", {"model": {"uri": "pvc://Bad_Claim/x"}}, "pvc:// must look like"),
    ("revision-pvc", {"model": {"uri": "pvc://c/x", "revision": "main"}}, "revision is only meaningful"),
    (
        "tp-vs-gpus",
        {"model": HF, "engine": {"tensorParallelSize": 2}, "resources": {"gpu": {"count": 1}}},
        "tensorParallelSize must equal",
    ),
    (
        "tp-cpu",
        {"model": HF, "engine": {"tensorParallelSize": 2}, "resources": {"gpu": {"count": 0}}},
        "tensorParallelSize",
    ),
    ("nodes-zero", {"model": HF, "parallelism": {"nodes": 0}}, "minimum"),
    ("nodes-over-max", {"model": HF, "parallelism": {"nodes": 33}}, "maximum"),
    (
        "min-over-max",
        {"model": HF, "scaling": {"minReplicas": 4, "maxReplicas": 2, "replicas": 2}},
        "minReplicas must be <= scaling.maxReplicas",
    ),
    (
        "replicas-over-max",
        {"model": HF, "scaling": {"replicas": 5, "maxReplicas": 3}},
        "replicas must lie within",
    ),
    (
        "replicas-under-min",
        {"model": HF, "scaling": {"replicas": 1, "minReplicas": 2}},
        "replicas must lie within",
    ),
    (
        "replicas-ignored-when-autoscaled",
        {"model": HF, "scaling": {"replicas": 1, "minReplicas": 2, "maxReplicas": 4, "autoscaler": "HPA"}},
        None,
    ),
    (
        "autoscaler-no-max",
        {"model": HF, "scaling": {"autoscaler": "HPA"}},
        "an autoscaler needs scaling.maxReplicas",
    ),
    (
        "keda-no-prometheus",
        {"model": HF, "scaling": {"autoscaler": "KEDA", "maxReplicas": 3}},
        "needs scaling.prometheusAddress",
    ),
    (
        "hpa-zero",
        {"model": HF, "scaling": {"autoscaler": "HPA", "minReplicas": 0, "replicas": 0, "maxReplicas": 3}},
        "an HPA cannot scale to zero",
    ),
    (
        "kv-target",
        {"model": HF, "scaling": {"metric": "KVCacheUsage", "target": 1.5}},
        "KVCacheUsage target is a fraction",
    ),
    ("kv-target-ok", {"model": HF, "scaling": {"metric": "KVCacheUsage", "target": 0.75}}, None),
    ("adapters-ok", {"model": HF, "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}]}, None),
    (
        "adapter-scheme",
        {"model": HF, "adapters": [{"name": "a", "uri": "s3://b/a"}]},
        "adapters[].uri must start",
    ),
    ("adapter-hf", {"model": HF, "adapters": [{"name": "a", "uri": "hf://a"}]}, "adapters[].uri hf:// must"),
    (
        "adapter-pvc",
        {"model": HF, "adapters": [{"name": "a", "uri": "pvc://B_/a"}]},
        "adapters[].uri pvc:// must",
    ),
    (
        "speculative-ok",
        {
            "model": HF,
            "engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 4}},
        },
        None,
    ),
    (
        "speculative-lookup",
        {
            "model": HF,
            "engine": {
                "speculative": {
                    "method": "ngram",
                    "numSpeculativeTokens": 3,
                    "promptLookupMin": 4,
                    "promptLookupMax": 2,
                }
            },
        },
        "promptLookupMin must be <= promptLookupMax",
    ),
    (
        "speculative-method",
        {"model": HF, "engine": {"speculative": {"method": "eagle", "numSpeculativeTokens": 3}}},
        'spec.engine.speculative.method: Unsupported value: "eagle": supported values: "ngram", "draft_model"',
    ),
    (
        "speculative-draft-ok",
        {
            "model": HF,
            "engine": {
                "speculative": {"method": "draft_model", "model": "hf://org/draft", "numSpeculativeTokens": 4}
            },
        },
        None,
    ),
    (
        "speculative-draft-no-model",
        {"model": HF, "engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 4}}},
        "model is required by method draft_model",
    ),
    (
        "speculative-ngram-with-model",
        {
            "model": HF,
            "engine": {
                "speculative": {"method": "ngram", "model": "hf://org/draft", "numSpeculativeTokens": 4}
            },
        },
        "model is required by method draft_model",
    ),
    (
        "speculative-draft-lookup",
        {
            "model": HF,
            "engine": {
                "speculative": {
                    "method": "draft_model",
                    "model": "hf://org/draft",
                    "numSpeculativeTokens": 4,
                    "promptLookupMax": 3,
                }
            },
        },
        "promptLookupMin/Max belong to the ngram method",
    ),
    (
        "speculative-draft-scheme",
        {
            "model": HF,
            "engine": {
                "speculative": {"method": "draft_model", "model": "s3://b/d", "numSpeculativeTokens": 4}
            },
        },
        "engine.speculative.model must start with",
    ),
    (
        "speculative-draft-hf",
        {
            "model": HF,
            "engine": {
                "speculative": {"method": "draft_model", "model": "hf://draft", "numSpeculativeTokens": 4}
            },
        },
        "engine.speculative.model hf:// must",
    ),
    (
        "speculative-draft-pvc",
        {
            "model": HF,
            "engine": {
                "speculative": {"method": "draft_model", "model": "pvc://B_/d", "numSpeculativeTokens": 4}
            },
        },
        "engine.speculative.model pvc:// must",
    ),
    (
        "speculative-k",
        {"model": HF, "engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 0}}},
        "minimum",
    ),
    (
        "keda-zero-ok",
        {
            "model": HF,
            "scaling": {
                "autoscaler": "KEDA",
                "minReplicas": 0,
                "replicas": 0,
                "maxReplicas": 3,
                "prometheusAddress": "http://p:9090",
            },
        },
        None,
    ),
]


@pytest.mark.parametrize(("name", "spec", "expected"), CASES, ids=[c[0] for c in CASES])
def test_crd_accepts_and_rejects(name: str, spec: dict[str, Any], expected: str | None) -> None:
    errors = crd_errors(inference_model(spec))
    if expected is None:
        assert errors == []
    else:
        assert any(expected in e for e in errors), errors


@pytest.mark.parametrize(("name", "spec", "expected"), CASES, ids=[c[0] for c in CASES])
def test_models_agree_with_the_crd(name: str, spec: dict[str, Any], expected: str | None) -> None:
    if expected is None:
        InferenceModel.from_manifest(inference_model(spec))
    else:
        with pytest.raises(InvalidSpecError):
            InferenceModel.from_manifest(inference_model(spec))


def test_every_cel_rule_is_exercised_by_a_rejected_case() -> None:
    messages = {r.message for r in cel_rules(crd_schema())}
    hit: set[str] = set()
    rows = [(spec, expected) for _, spec, expected in CASES] + [(r.spec, r.refusal) for r in ADMISSION]
    for spec, expected in rows:
        if expected is not None:
            errors = crd_errors(inference_model(spec))
            hit |= {m for m in messages if m in errors}
    assert hit == messages


@pytest.mark.parametrize("rule", cel_rules(crd_schema()), ids=lambda r: r.message[:40])
def test_each_cel_rule_compiles_and_passes_on_the_defaults(rule: Any) -> None:
    # The defaulted minimal spec is valid, so every rule must evaluate to true on its node.
    from op_testlib import apply_defaults

    minimal = {
        "model": {**HF, "credentialsSecretRef": {"name": "hf"}},
        "engine": {"apiKeySecretRef": {"name": "api"}},
    }
    if rule.path.startswith("spec.canary"):  # the canary's copies of the model's rules, on a canary
        minimal["canary"] = {"model": minimal["model"], "weight": 10}
    spec = apply_defaults(crd_schema()["properties"]["spec"], minimal)
    node: Any = {"spec": spec}
    for part in rule.path.split("."):
        if part.endswith("[]"):  # list items have no defaults: a valid sample item (adapters)
            node = {"name": "a", "uri": "hf://org/a"}
            continue
        node = node[part]
    assert evaluate_cel(rule.rule, node) is True


def _model_fields(model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        alias = field.alias or name
        sub = None
        ann = field.annotation
        for cand in getattr(ann, "__args__", ()) or (ann,):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                sub = cand
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sub = ann
        out[alias] = _model_fields(sub) if sub is not None else None
    return out


def _schema_fields(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, sub in (node.get("properties") or {}).items():
        nested = "properties" in sub and not sub.get("x-kubernetes-preserve-unknown-fields")
        items = sub.get("items") or {}
        if (
            sub.get("type") == "array"
            and "properties" in items
            and not items.get("x-kubernetes-preserve-unknown-fields")
        ):
            out[key] = _schema_fields(sub["items"])  # a list of objects: compare the item's fields
            continue
        out[key] = _schema_fields(sub) if nested else None
    return out


def test_spec_and_status_models_match_the_crd_field_for_field() -> None:
    schema = crd_schema()["properties"]
    assert _model_fields(InferenceModelSpec) == _schema_fields(schema["spec"])
    status_fields = _schema_fields(schema["status"])
    model_status = _model_fields(InferenceModelStatus)
    assert set(model_status) == set(status_fields)
    assert set(model_status["conditions"] or _condition_fields()) == set(
        _schema_fields(schema["status"]["properties"]["conditions"]["items"])
    )


def _condition_fields() -> dict[str, Any]:
    from kubeinfer_operator.spec import Condition

    return _model_fields(Condition)


def test_model_defaults_match_crd_defaults() -> None:
    from op_testlib import apply_defaults

    defaulted = apply_defaults(crd_schema()["properties"]["spec"], {"model": HF})
    spec = InferenceModelSpec.model_validate({"model": HF})
    dumped = spec.model_dump(by_alias=True, exclude_none=True)

    def drop_empty(d: Any) -> Any:
        if isinstance(d, dict):
            cleaned = {k: drop_empty(v) for k, v in d.items()}
            return {k: v for k, v in cleaned.items() if v not in ({}, [])}
        return d

    assert drop_empty(dumped) == drop_empty(defaulted)
    assert DEFAULT_SERVER_IMAGE.startswith("ghcr.io/kubeinfer/server:")
