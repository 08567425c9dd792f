"""A CRD's x-kubernetes-validations evaluated the way kube-apiserver evaluates them, without one.

Shared by the operator tests (tests/operator) and the deploy mocks (tests/deploy); tests/ is on sys.path.
What it reproduces (k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel/validation.go and
schema/defaulting/validation.go, Kubernetes 1.36):

- values are typed by their schema before CEL sees them: `type: number` is a double even when written
  as 1, `x-kubernetes-int-or-string` is an int or a string, maps and lists as they are;
- every rule of a node is evaluated on that node's value, then the validator descends into the
  properties, items and additionalProperties *present* in the value;
- at CRD creation every `default` is validated against its node's rules (and those of the nodes
  below it that the default fills) exactly as written: nested defaults are NOT applied first, so a rule
  that reads a defaulted field without has() fails on `default: {}` with "no such key";
- a rule that errors fails with `<error> evaluating rule: <message>`, one that is false with `<message>`.

The CEL implementation: cel-expr-python, the Python binding of Google's cel-cpp (the CEL project's
own C++ runtime, RE2 regular expressions like cel-go's). Chosen by measuring against kube-apiserver
v1.36.2 (docs/operator.md, "What the tests stand in for"): cel-python, common-expression-language and
cel-expr-python all agreed with it on the 7,736 evaluations of our rules we compared; outside them
cel-python refuses `int < double` (Kubernetes allows cross-type numeric comparisons since 1.28) and
common-expression-language's size() counts bytes, not code points, where cel-expr-python agreed.
Our rules use only CEL's standard library (has, matches, startsWith, exists, all, in, type, size);
tests/operator/test_op_crd_apiserver.py checks that no rule calls a Kubernetes extension function
(quantity, format, lists, strings ...), which this runtime would not have.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel


@dataclass(frozen=True)
class RuleFailure:
    """One rule that did not hold: where (a Kubernetes field path), the rule, and the API server's
    wording of the reason (`<message>` when false, `<error> evaluating rule: <message>` on an error)."""

    path: str
    rule: str
    message: str
    detail: str


@functools.cache
def _env() -> Any:
    return cel.NewEnv(variables={"self": cel.Type.DYN, "oldSelf": cel.Type.DYN})


@functools.cache
def _compiled(rule: str) -> Any:
    return _env().compile(rule)


def compile_errors(rule: str) -> str | None:
    """None when the rule parses and checks (with `self` dynamic), else the compiler's message."""
    try:
        _compiled(rule)
    except Exception as exc:  # cel-cpp raises plain exceptions carrying the compiler's text
        return str(exc)
    return None


def evaluate(rule: str, value: Any) -> bool | str:
    """True/False, or the evaluation error's text (e.g. `no such key` when a field is missing)."""
    result = _compiled(rule).eval(data={"self": value, "oldSelf": value})
    out = result.value()
    if result.type() == cel.Type.BOOL:
        return bool(out)
    if result.type() == cel.Type.ERROR:
        return str(out)
    return f"rule returned {result.type().name()}, not bool"


@functools.cache
def _compiled_with(rule: str, names: tuple[str, ...]) -> Any:
    return cel.NewEnv(variables=dict.fromkeys(names, cel.Type.DYN)).compile(rule)


def evaluate_vars(rule: str, variables: dict[str, Any]) -> bool | str:
    """Like `evaluate`, for an admission expression over other variables (`object`, `request`:
    a ValidatingAdmissionPolicy's)."""
    result = _compiled_with(rule, tuple(sorted(variables))).eval(data=variables)
    if result.type() == cel.Type.BOOL:
        return bool(result.value())
    return str(result.value())


def typed(schema: dict[str, Any], value: Any) -> Any:
    """The value as the API server hands it to CEL: numbers of a `type: number` node are doubles."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, sub in value.items():
            sub_schema = props.get(key) or (extra if isinstance(extra, dict) else {})
            out[key] = typed(sub_schema, sub)
        return out
    if isinstance(value, list):
        return [typed(schema.get("items") or {}, item) for item in value]
    return value


def _api_reason(detail: str) -> str:
    # cel-cpp says `Key not found in map : "x"`; cel-go (the API server) says `no such key: x`.
    marker = "Key not found in map"
    if marker in detail:
        key = detail.split(marker, 1)[1].strip(' :"')
        return f"no such key: {key}"
    return detail


def rule_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[RuleFailure]:
    """Every rule of `schema` and of the nodes below it that `value` fills, evaluated on `value`
    (typed by the schema first). Returns the failures, in schema order."""
    return list(_failures(schema, typed(schema, value), path))


def _failures(schema: dict[str, Any], value: Any, path: str) -> Iterator[RuleFailure]:
    for r in schema.get("x-kubernetes-validations") or []:
        message = r.get("message") or f"failed rule: {r['rule']}"
        result = evaluate(r["rule"], value)
        if result is True:
            continue
        detail = message if result is False else f"{_api_reason(str(result))} evaluating rule: {message}"
        yield RuleFailure(path, r["rule"], message, detail)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                yield from _failures(props[key], sub, f"{path}.{key}" if path else key)
            elif isinstance(extra, dict):
                yield from _failures(extra, sub, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _failures(schema["items"], item, f"{path}[{i}]")


def schema_nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(Kubernetes' path of the schema node, node) for the node and every node below it, in the API
    server's spelling: `properties[spec].properties[scaling]`, `items`, `additionalProperties`."""
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from schema_nodes(sub, f"{path}.properties[{key}]" if path else f"properties[{key}]")
    if isinstance(schema.get("items"), dict):
        yield from schema_nodes(schema["items"], f"{path}.items" if path else "items")
    if isinstance(schema.get("additionalProperties"), dict):
        sub_path = f"{path}.additionalProperties" if path else "additionalProperties"
        yield from schema_nodes(schema["additionalProperties"], sub_path)


def default_errors(schema: dict[str, Any], prefix: str = "openAPIV3Schema") -> list[str]:
    """What the API server says about the CRD's defaults when it creates the CRD (the CEL part of
    ValidateDefaults): each `default` checked, as written, against the rules of its node and below."""
    errors = []
    for path, node in schema_nodes(schema):
        if "default" not in node:
            continue
        where = f"{prefix}.{path}.default" if path else f"{prefix}.default"
        kind = "object" if isinstance(node["default"], dict) else type(node["default"]).__name__
        for failure in rule_failures(node, node["default"]):
            errors.append(f'{where}: Invalid value: "{kind}": {failure.detail}')
    return errors
