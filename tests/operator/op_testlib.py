"""Helpers for the operator tests: the CRD's schema as the API server applies it (structural schema ->
JSON Schema, defaulting, CEL rules as the API server evaluates them: tests/crd_cel.py), plus paths and
small loaders."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crd_cel
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kubeinfer.dev_inferencemodels.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest we support (preStop sleep action) and newest shipped


def load_yaml(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def load_crd() -> dict[str, Any]:
    return load_yaml(CRD_PATH)


@functools.cache
def _crd_schema_cached() -> dict[str, Any]:
    (version,) = load_crd()["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


@functools.cache
def _crd_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(to_jsonschema(_crd_schema_cached()))


def crd_schema() -> dict[str, Any]:
    """A fresh copy: tests may not mutate the shared one."""
    return copy.deepcopy(_crd_schema_cached())


def load_json_schema(name: str) -> dict[str, Any]:
    out = json.loads((SCHEMAS / name).read_text())
    assert isinstance(out, dict)
    return out


@functools.cache
def _lws_validator() -> jsonschema.Draft202012Validator:
    vendored = load_json_schema("leaderworkerset.x-k8s.io_v1.json")
    return jsonschema.Draft202012Validator(to_jsonschema(vendored["openAPIV3Schema"]))


def lws_errors(obj: dict[str, Any]) -> list[str]:
    """What the LWS CRD's schema (vendored from kubernetes-sigs/lws, strict) refuses in a LeaderWorkerSet."""
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _lws_validator().iter_errors(obj)]


def to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """Translate a structural OpenAPI v3 schema into JSON Schema with the API server's strictness:
    unknown fields are errors (kubectl's default strict field validation), except where
    x-kubernetes-preserve-unknown-fields allows them."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "nullable"):
            continue
        if key == "properties":
            out["properties"] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key == "items":
            out["items"] = to_jsonschema(value)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = to_jsonschema(value)
        elif key == "anyOf":
            out["anyOf"] = [to_jsonschema(v) for v in value]
        elif key == "exclusiveMinimum" and value is True:
            out["exclusiveMinimum"] = node["minimum"]
        elif key == "minimum" and node.get("exclusiveMinimum") is True:
            continue
        elif key == "format" and value == "date-time":
            continue  # the API server parses it; jsonschema would ignore it anyway
        else:
            out[key] = value
    if (
        node.get("type") == "object"
        and "properties" in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out.setdefault("additionalProperties", False)
    if node.get("type") == "object" and node.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: a missing field with a default gets it, then
    defaulting recurses into it. Also turns `type: number` values into floats, as CEL sees them."""
    if schema.get("type") == "number" and isinstance(obj, int) and not isinstance(obj, bool):
        return float(obj)
    if isinstance(obj, dict) and "properties" in schema:
        out = dict(obj)
        for key, sub in schema["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        return out
    if isinstance(obj, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


@dataclass(frozen=True)
class CelRule:
    path: str  # dotted path of the schema node that carries the rule
    rule: str
    message: str


def cel_rules(schema: dict[str, Any], path: str = "") -> list[CelRule]:
    rules = [
        CelRule(path, r["rule"], r.get("message", r["rule"]))
        for r in schema.get("x-kubernetes-validations", [])
    ]
    for key, sub in (schema.get("properties") or {}).items():
        rules += cel_rules(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        rules += cel_rules(schema["items"], f"{path}[]")
    return rules


def evaluate_cel(rule: str, value: Any) -> bool:
    """The rule on the value, as the API server evaluates it (tests/crd_cel.py: cel-expr-python);
    an evaluation error (e.g. a missing field read without has()) raises."""
    result = crd_cel.evaluate(rule, value)
    if isinstance(result, str):
        raise ValueError(f"{result} evaluating rule: {rule}")
    return result


def _cel_failures(schema: dict[str, Any], value: Any) -> list[str]:
    failures = [
        r.get("message", r["rule"])
        for r in schema.get("x-kubernetes-validations", [])
        if not evaluate_cel(r["rule"], value)
    ]
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                failures += _cel_failures(sub, value[key])
    if isinstance(value, list) and "items" in schema:
        for item in value:
            failures += _cel_failures(schema["items"], item)
    return failures


def _go_quote(value: Any) -> str:
    """A value as Go's %q / %v print it in the API server's field errors (strings JSON-quoted)."""
    return json.dumps(value) if isinstance(value, str) else str(value)


def _schema_error(e: jsonschema.ValidationError) -> str:
    path = ".".join(map(str, e.absolute_path))
    # The size bounds, enums and patterns in the API server's words (seen on v1.36.2), the rest in
    # jsonschema's.
    api_path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path).lstrip(".")
    if e.validator == "enum":
        supported = ", ".join(_go_quote(v) for v in e.validator_value)
        return f"{api_path}: Unsupported value: {_go_quote(e.instance)}: supported values: {supported}"
    if e.validator == "pattern":
        return f"{api_path} in body should match '{e.validator_value}'"
    if e.validator in ("maxItems", "maxProperties"):
        return f"{api_path}: Too many: {len(e.instance)}: must have at most {e.validator_value} items"
    if e.validator == "maxLength":
        return f"{api_path}: Too long: may not be more than {e.validator_value} bytes"
    return f"{path}: {e.message}"


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Everything the API server would reject the object for: schema, then (after defaulting) CEL."""
    schema = _crd_schema_cached()
    validator = _crd_validator()
    errors = [_schema_error(e) for e in validator.iter_errors(obj)]
    if errors:
        return errors
    return _cel_failures(schema, apply_defaults(schema, obj))


def inference_model(spec: dict[str, Any], name: str = "m", namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "kubeinfer.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
