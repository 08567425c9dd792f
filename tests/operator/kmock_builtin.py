"""The built-in kinds the operator writes, as kube-apiserver v1.36.2 decodes and validates them, for kmock.

kmock stored any Deployment, Service, ... whatever it held: an unknown field, a string `replicas`, a
container without a name or a Deployment whose selector misses its template's labels all passed the mock
and failed (or were silently dropped) on a real cluster. This module gives kmock what the real server
does before it stores such an object:

- the schemas: `schemas/builtin.k8s.io_openapi_v3.json`, the server's own `/openapi/v3` components
  reachable from the kinds below, trimmed to the structural keys; `builtin_schemas()` resolves them for
  kmock_pruning (unknown fields are dropped, and refused or warned about under `fieldValidation`);
- the JSON decoder's type errors (`400 BadRequest ... json: cannot unmarshal string into Go struct field
  DeploymentSpec.spec.replicas of type int32`), `type_error`;
- the validation refusals with their causes (`422 Invalid`, a `FieldValueRequired` cause naming
  `spec.template.spec.containers[0].name`), `invalid_causes` and `update_causes`.

kmock_builtin_answers.json holds the real server's answers that test_op_kmock_builtin.py replays here.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

from kmock import KubernetesError

SCHEMA_FILE = pathlib.Path(__file__).parent / "schemas" / "builtin.k8s.io_openapi_v3.json"
# plural -> (kind, the group the error messages qualify the kind with; "" for the core group)
PLURALS = {
    "deployments": ("Deployment", "apps"),
    "services": ("Service", ""),
    "serviceaccounts": ("ServiceAccount", ""),
    "configmaps": ("ConfigMap", ""),
    "horizontalpodautoscalers": ("HorizontalPodAutoscaler", "autoscaling"),
    "poddisruptionbudgets": ("PodDisruptionBudget", "policy"),
    "networkpolicies": ("NetworkPolicy", "networking.k8s.io"),
    "jobs": ("Job", "batch"),
    "persistentvolumeclaims": ("PersistentVolumeClaim", ""),
}
# Definitions decoded from a JSON string or number alike (resource.Quantity, intstr.IntOrString).
_SCALARS = (
    "io.k8s.apimachinery.pkg.api.resource.Quantity",
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString",
)


@functools.cache
def _definitions() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())["definitions"]  # type: ignore[no-any-return]


def _resolve(node: dict[str, Any], seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """`node` with its `$ref`s (and single-`$ref` allOf) inlined; an object from a definition carries
    `x-go-type` (`v1.Container`) and `x-go-struct` (`Container`) for the decoder's messages."""
    ref = node.get("$ref")
    if ref is None and len(node.get("allOf") or []) == 1:
        ref = node["allOf"][0].get("$ref")
    if ref is not None:
        assert ref not in seen, f"recursive schema at {ref}"  # none among the kinds kept
        if ref in _SCALARS:
            return {"x-scalar": True}
        target = _resolve(_definitions()[ref], (*seen, ref))
        if target.get("type") == "object" or "properties" in target:
            parts = ref.split(".")
            target = {**target, "x-go-type": f"{parts[-2]}.{parts[-1]}", "x-go-struct": parts[-1]}
        return target
    out = {k: v for k, v in node.items() if k not in ("properties", "items", "additionalProperties")}
    if "properties" in node:
        out["properties"] = {k: _resolve(v, seen) for k, v in node["properties"].items()}
        out.setdefault("type", "object")
    if isinstance(node.get("items"), dict):
        out["items"] = _resolve(node["items"], seen)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _resolve(node["additionalProperties"], seen)
    if node.get("format") == "int-or-string":
        out["x-scalar"] = True
    return out


@functools.cache
def _schemas() -> dict[str, dict[str, Any]]:
    kinds = json.loads(SCHEMA_FILE.read_text())["kinds"]
    return {plural: _resolve({"$ref": kinds[kind]}) for plural, (kind, _) in PLURALS.items()}


def builtin_schemas() -> dict[str, dict[str, Any]]:
    """Structural schemas by plural, for kmock_pruning (shared: callers must not mutate them)."""
    return dict(_schemas())


def _go_type(schema: dict[str, Any]) -> str:
    if "x-go-type" in schema:
        return str(schema["x-go-type"])
    kind = schema.get("type")
    if kind == "integer":
        return str(schema.get("format") or "int64")
    if kind == "boolean":
        return "bool"
    if kind == "number":
        return "float64"
    if kind == "array":
        return "[]" + _go_type(schema.get("items") or {})
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map[string]" + _go_type(schema["additionalProperties"])
    return "string"


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    if value is None or not schema:
        return True  # null decodes into anything; a schemaless node takes any JSON
    if schema.get("x-scalar"):
        return not isinstance(value, dict | list)
    kind = schema.get("type") or ("object" if "properties" in schema else None)
    return {
        "integer": isinstance(value, int | float) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }.get(str(kind), True)


def _first_type_error(value: Any, schema: dict[str, Any], struct: str, path: str) -> str | None:
    """Go's decoder reports the first mismatch in document order: the innermost struct, the field's
    JSON path without indices or map keys, and the Go type it wanted."""
    if not _fits(value, schema):
        return (
            f"json: cannot unmarshal {_json_type(value)} into Go struct field {struct}.{path} "
            f"of type {_go_type(schema)}"
        )
    if isinstance(value, dict) and "properties" in schema:
        inner = str(schema.get("x-go-struct") or struct)
        for key, sub in value.items():
            sub_schema = schema["properties"].get(key)
            if sub_schema is not None:
                found = _first_type_error(sub, sub_schema, inner, f"{path}.{key}" if path else key)
                if found:
                    return found
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for sub in value.values():
            found = _first_type_error(sub, schema["additionalProperties"], struct, path)
            if found:
                return found
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for sub in value:
            found = _first_type_error(sub, schema["items"], struct, path)
            if found:
                return found
    return None


def type_error(plural: str, obj: dict[str, Any]) -> KubernetesError | None:
    """The real server's 400 for a create or replace body of a built-in kind whose JSON does not fit
    its Go types (None when it fits, or for a kind without a schema here)."""
    if plural not in PLURALS or not isinstance(obj, dict):
        return None
    kind = PLURALS[plural][0]
    schema = _schemas()[plural]
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    found = _first_type_error(body, schema, kind, "")
    if found is None:
        return None
    version = str(obj.get("apiVersion") or "").rsplit("/", 1)[-1]
    return KubernetesError(
        status=400,
        reason="BadRequest",
        message=f'{kind} in version "{version}" cannot be handled as a {kind}: {found}',
    )


def _required(field: str, detail: str = "") -> dict[str, str]:
    message = "Required value" + (f": {detail}" if detail else "")
    return {"reason": "FieldValueRequired", "message": message, "field": field}


def _invalid(field: str, value: Any, detail: str) -> dict[str, str]:
    shown = json.dumps(value, separators=(",", ":"))
    return {"reason": "FieldValueInvalid", "message": f"Invalid value: {shown}: {detail}", "field": field}


def _pod_causes(template: dict[str, Any], where: str) -> list[dict[str, str]]:
    spec = template.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        return [_required(f"{where}.spec.containers")]
    causes = []
    for i, container in enumerate(containers):
        if not container.get("name"):
            causes.append(_required(f"{where}.spec.containers[{i}].name"))
        if not container.get("image"):
            causes.append(_required(f"{where}.spec.containers[{i}].image"))
    return causes


def _selector_matches(selector: dict[str, Any], labels: dict[str, Any]) -> bool:
    """matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) against a label map."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and key in labels and labels[key] in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def invalid_causes(plural: str, obj: dict[str, Any]) -> list[dict[str, str]]:
    """The validation causes the real server gives a create of `obj` (k8s.io/kubernetes
    pkg/apis/{apps,core,autoscaling,batch}/validation, as far as the recorded answers go)."""
    spec = obj.get("spec") or {}
    causes: list[dict[str, str]] = []
    if plural == "deployments":
        selector = spec.get("selector")
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if selector is None:
            causes.append(_required("spec.selector"))
        elif not (selector.get("matchLabels") or selector.get("matchExpressions")):
            causes.append(_invalid("spec.selector", selector, "empty selector is invalid for deployment"))
        if (selector is None or selector.get("matchLabels") or selector.get("matchExpressions")) and not (
            selector is not None and _selector_matches(selector, labels)
        ):
            causes.append(
                _invalid(
                    "spec.template.metadata.labels", labels, "`selector` does not match template `labels`"
                )
            )
        causes += _pod_causes(spec.get("template") or {}, "spec.template")
    elif plural == "jobs":
        causes += _pod_causes(spec.get("template") or {}, "spec.template")
    elif plural == "services":
        for i, port in enumerate(spec.get("ports") or []):
            number = port.get("port") or 0
            if not 1 <= number <= 65535:
                causes.append(
                    _invalid(f"spec.ports[{i}].port", number, "must be between 1 and 65535, inclusive")
                )
    elif plural == "horizontalpodautoscalers":
        ref = spec.get("scaleTargetRef") or {}
        if not ref.get("kind"):
            causes.append(_required("spec.scaleTargetRef.kind"))
        if not ref.get("name"):
            causes.append(_required("spec.scaleTargetRef.name"))
        if "/" not in str(ref.get("apiVersion") or "") and ref.get("apiVersion") != "v1":
            causes.append(
                _invalid(
                    "spec.scaleTargetRef.apiVersion",
                    ref.get("apiVersion") or "",
                    "apiVersion must specify API group",
                )
            )
        maximum, minimum = spec.get("maxReplicas") or 0, spec.get("minReplicas", 1)
        if maximum <= 0:
            causes.append(_required("spec.maxReplicas", "must be set and greater than 0"))
        if maximum < minimum:
            causes.append(
                _invalid("spec.maxReplicas", maximum, "must be greater than or equal to `minReplicas`")
            )
    elif plural == "persistentvolumeclaims" and "storage" not in (
        (spec.get("resources") or {}).get("requests") or {}
    ):
        causes.append(_required("spec.resources[storage]"))
    return causes


def update_causes(plural: str, old: dict[str, Any], new_spec: dict[str, Any]) -> list[dict[str, str]]:
    """The immutable fields an update of the live `old` to `new_spec` (the patch merged) changes."""
    old_spec = old.get("spec") or {}
    if plural == "deployments" and new_spec.get("selector") != old_spec.get("selector"):
        return [_invalid("spec.selector", new_spec.get("selector"), "field is immutable")]
    if plural == "jobs" and new_spec.get("template") != old_spec.get("template"):
        # The real message shows the template as a Go struct dump (uids included): only the tail is kept.
        return [
            {
                "reason": "FieldValueInvalid",
                "message": "Invalid value: ...: field is immutable",
                "field": "spec.template",
            }
        ]
    if (
        plural == "services"
        and old_spec.get("clusterIP")
        and new_spec.get("clusterIP") != old_spec["clusterIP"]
    ):
        ips = [new_spec.get("clusterIP")]
        return [_invalid("spec.clusterIPs[0]", ips, "may not change once set")]
    return []


def refusal(plural: str, obj: dict[str, Any], name: str, causes: list[dict[str, str]]) -> KubernetesError:
    """The 422 for `causes` as the real server words it: `Deployment.apps "d" is invalid: ...`."""
    kind, group = PLURALS[plural]
    listed = [f"{c['field']}: {c['message']}" for c in causes]
    joined = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    qualified = f"{kind}.{group}" if group else kind
    return KubernetesError(
        status=422,
        reason="Invalid",
        message=f'{qualified} "{name}" is invalid: {joined}',
        details={"name": name, "group": group, "kind": kind, "causes": causes},
    )
