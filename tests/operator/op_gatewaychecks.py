"""The refusals a real kube-apiserver makes to the Gateway API Inference Extension's InferencePool
(inference.networking.k8s.io/v1, the extension's v1.6.0 CRD) and the Gateway API's HTTPRoute
(gateway.networking.k8s.io/v1, its v1.6.1 standard CRD) and the extension's InferenceObjective
(inference.networking.x-k8s.io/v1alpha2, its v1.5.0 CRD: v1.6.0 dropped the API), for kmock and the render tests. Written from
the two projects' published CRDs (read, not vendored): required fields, bounds, patterns, enums, and
the CEL rules of the fields the operator writes. Messages name the field as the API server does
(`spec.rules[0].backendRefs[0].weight: Invalid value: ...`); tests/operator/test_op_gateway_apiserver.py
holds the verdicts seen on kube-apiserver v1.36.2 (issue 48) that these must reproduce.

Two kinds of refusal, as on the real server:
- `gateway_invalid`: schema and CEL errors, 422 Invalid on every write;
- `gateway_undeclared`: fields the schema does not declare. A server-side apply is refused with
  500 `failed to create typed patch object (...): .spec.foo: field not declared in schema`; a create or
  update prunes them silently (the operator only applies).
"""

from __future__ import annotations

import re
from typing import Any

GATEWAY_KINDS = ("InferencePool", "HTTPRoute", "InferenceObjective")

_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_NAMESPACE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_SECTION = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_PATH_CHARS = r"^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$"

# The fields each object the operator writes may have (everything else is undeclared).
_POOL_SPEC = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
_EPP_REF = {"group", "kind", "name", "port", "failureMode"}
_ROUTE_SPEC = {"parentRefs", "hostnames", "rules"}
_PARENT_REF = {"group", "kind", "namespace", "name", "sectionName", "port"}
_ROUTE_RULE = {"name", "matches", "filters", "backendRefs", "timeouts"}
_MATCH = {"path", "headers", "queryParams", "method"}
_BACKEND_REF = {"group", "kind", "name", "namespace", "port", "weight", "filters"}


class _Errors(list[str]):
    def string(
        self,
        where: str,
        value: Any,
        *,
        pattern: str | None = None,
        min_length: int = 0,
        max_length: int | None = None,
    ) -> None:
        if not isinstance(value, str):
            self.append(
                f'{where}: Invalid value: "{type(value).__name__}": {where} in body must be of type string'
            )
            return
        if max_length is not None and len(value.encode()) > max_length:
            self.append(f"{where}: Too long: may not be more than {max_length} bytes")
        elif len(value) < min_length:
            self.append(
                f'{where}: Invalid value: "{value}": {where} in body should be at least {min_length} chars long'
            )
        elif pattern is not None and not re.search(pattern, value):
            self.append(f"{where}: Invalid value: \"{value}\": {where} in body should match '{pattern}'")

    def integer(self, where: str, value: Any, low: int, high: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            self.append(f'{where}: Invalid value: "{value}": {where} in body must be of type integer')
        elif value < low:
            self.append(
                f"{where}: Invalid value: {value}: {where} in body should be greater than or equal to {low}"
            )
        elif value > high:
            self.append(
                f"{where}: Invalid value: {value}: {where} in body should be less than or equal to {high}"
            )

    def items(self, where: str, value: Any, low: int, high: int) -> list[Any]:
        if not isinstance(value, list):
            self.append(
                f'{where}: Invalid value: "{type(value).__name__}": {where} in body must be of type array'
            )
            return []
        if len(value) > high:
            self.append(f"{where}: Too many: {len(value)}: must have at most {high} items")
        elif len(value) < low:
            self.append(
                f"{where}: Invalid value: {len(value)}: {where} in body should have at least {low} items"
            )
        return value

    def enum(self, where: str, value: Any, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            supported = ", ".join(f'"{a}"' for a in allowed)
            self.append(f'{where}: Unsupported value: "{value}": supported values: {supported}')


def _undeclared(obj: Any, allowed: set[str], where: str) -> list[str]:
    if not isinstance(obj, dict):
        return []
    return [f"{where}.{key}" for key in sorted(set(obj) - allowed)]


def _pool_invalid(spec: dict[str, Any]) -> list[str]:
    e = _Errors()
    selector = spec.get("selector")
    if not isinstance(selector, dict):
        e.append("spec.selector: Required value")
    elif not isinstance(selector.get("matchLabels"), dict):
        e.append("spec.selector.matchLabels: Required value")
    else:
        labels = selector["matchLabels"]
        if len(labels) > 64:
            e.append(f"spec.selector.matchLabels: Too many: {len(labels)}: must have at most 64 items")
        elif not labels:
            e.append(
                "spec.selector.matchLabels: Invalid value: 0: spec.selector.matchLabels in body should have at least 1 properties"
            )
        for key, value in labels.items():  # the CRD checks values only, not keys
            e.string(f"spec.selector.matchLabels.{key}", value, pattern=_LABEL_VALUE, max_length=63)
    if "targetPorts" not in spec:
        e.append("spec.targetPorts: Required value")
    else:
        ports = e.items("spec.targetPorts", spec["targetPorts"], 1, 8)
        for i, port in enumerate(ports):
            if "number" not in (port or {}):
                e.append(f"spec.targetPorts[{i}].number: Required value")
            else:
                e.integer(f"spec.targetPorts[{i}].number", port["number"], 1, 65535)
        numbers = [(p or {}).get("number") for p in ports]
        if len(set(map(str, numbers))) != len(numbers):
            e.append("spec.targetPorts: Invalid value: port number must be unique")
    if "appProtocol" in spec:
        e.enum("spec.appProtocol", spec["appProtocol"], ("http", "kubernetes.io/h2c"))
    ref = spec.get("endpointPickerRef")
    if isinstance(ref, dict):  # optional in the v1.6.0 CRD
        where = "spec.endpointPickerRef"
        if "name" not in ref:
            e.append(f"{where}.name: Required value")
        else:
            e.string(f"{where}.name", ref["name"], min_length=1, max_length=253)
        if "kind" in ref:
            e.string(f"{where}.kind", ref["kind"], pattern=_KIND, min_length=1, max_length=63)
        if "group" in ref:
            e.string(f"{where}.group", ref["group"], pattern=_GROUP, max_length=253)
        if "port" in ref:
            if "number" not in (ref["port"] or {}):
                e.append(f"{where}.port.number: Required value")
            else:
                e.integer(f"{where}.port.number", ref["port"]["number"], 1, 65535)
        if "failureMode" in ref:
            e.enum(f"{where}.failureMode", ref["failureMode"], ("FailOpen", "FailClose"))
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            e.append(
                f"{where}: Invalid value: port is required when kind is 'Service' or unspecified (defaults to 'Service')"
            )
    return e


def _path_errors(e: _Errors, path: Any, where: str) -> None:
    if not isinstance(path, dict):
        return
    kind = path.get("type", "PathPrefix")
    value = path.get("value", "/")
    e.enum(f"{where}.type", kind, ("Exact", "PathPrefix", "RegularExpression"))
    e.string(f"{where}.value", value, max_length=1024)
    if kind not in ("Exact", "PathPrefix") or not isinstance(value, str):
        return
    # The path's CEL rules, in the CRD's order and words.
    if not value.startswith("/"):
        e.append(
            f"{where}: Invalid value: value must be an absolute path and start with '/' when type one of ['Exact', 'PathPrefix']"
        )
    for bad in ("//", "/./", "/../", "%2f", "%2F", "#"):
        if bad in value:
            e.append(
                f"{where}: Invalid value: must not contain '{bad}' when type one of ['Exact', 'PathPrefix']"
            )
    for end in ("/..", "/."):
        if value.endswith(end):
            e.append(
                f"{where}: Invalid value: must not end with '{end}' when type one of ['Exact', 'PathPrefix']"
            )
    if not re.match(_PATH_CHARS, value):
        e.append(
            f"{where}: Invalid value: must only contain valid characters (matching {_PATH_CHARS}) for types ['Exact', 'PathPrefix']"
        )


def _parent_key(ref: dict[str, Any]) -> tuple[Any, ...]:
    return (
        ref.get("group", "gateway.networking.k8s.io"),
        ref.get("kind", "Gateway"),
        ref.get("name"),
        ref.get("namespace") or "",
    )


def _route_invalid(spec: dict[str, Any]) -> list[str]:
    e = _Errors()
    parents = e.items("spec.parentRefs", spec.get("parentRefs", []), 0, 32)
    for i, ref in enumerate(parents):
        where = f"spec.parentRefs[{i}]"
        if "name" not in (ref or {}):
            e.append(f"{where}.name: Required value")
            continue
        e.string(f"{where}.name", ref["name"], min_length=1, max_length=253)
        for field, pattern, low, high in (
            ("group", _GROUP, 0, 253),
            ("kind", _KIND, 1, 63),
            ("namespace", _NAMESPACE, 1, 63),
            ("sectionName", _SECTION, 1, 253),
        ):
            if field in ref:
                e.string(f"{where}.{field}", ref[field], pattern=pattern, min_length=low, max_length=high)
        if "port" in ref:
            e.integer(f"{where}.port", ref["port"], 1, 65535)
    # The two CEL rules over parentRefs: refs to one parent all name a sectionName or none does, and
    # no two of them name the same one (two without a sectionName count as the same).
    named = [p for p in parents if isinstance(p, dict) and "name" in p]
    same = [(p, q) for p in named for q in named if p is not q and _parent_key(p) == _parent_key(q)]
    if any(bool(p.get("sectionName")) != bool(q.get("sectionName")) for p, q in same):
        e.append(
            "spec.parentRefs: Invalid value: sectionName must be specified when parentRefs includes 2 or "
            "more references to the same parent"
        )
    if any((p.get("sectionName") or "") == (q.get("sectionName") or "") for p, q in same):
        e.append(
            "spec.parentRefs: Invalid value: sectionName must be unique when parentRefs includes 2 or more "
            "references to the same parent"
        )
    for i, host in enumerate(e.items("spec.hostnames", spec.get("hostnames", []), 0, 16)):
        e.string(f"spec.hostnames[{i}]", host, pattern=_HOSTNAME, min_length=1, max_length=253)
    rules = e.items("spec.rules", spec.get("rules", [{}]), 1, 16)
    total_matches = 0
    for i, rule in enumerate(rules):
        rule = rule or {}
        matches = e.items(f"spec.rules[{i}].matches", rule.get("matches", [{}]), 0, 64)
        total_matches += len(matches)
        for j, match in enumerate(matches):
            _path_errors(e, (match or {}).get("path", {}), f"spec.rules[{i}].matches[{j}].path")
        for j, ref in enumerate(e.items(f"spec.rules[{i}].backendRefs", rule.get("backendRefs", []), 0, 16)):
            where = f"spec.rules[{i}].backendRefs[{j}]"
            ref = ref or {}
            if "name" not in ref:
                e.append(f"{where}.name: Required value")
            else:
                e.string(f"{where}.name", ref["name"], min_length=1, max_length=253)
            for field, pattern, low, high in (
                ("group", _GROUP, 0, 253),
                ("kind", _KIND, 1, 63),
                ("namespace", _NAMESPACE, 1, 63),
            ):
                if field in ref:
                    e.string(f"{where}.{field}", ref[field], pattern=pattern, min_length=low, max_length=high)
            if "port" in ref:
                e.integer(f"{where}.port", ref["port"], 1, 65535)
            if "weight" in ref:
                e.integer(f"{where}.weight", ref["weight"], 0, 1_000_000)
            if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and "port" not in ref:
                e.append(f"{where}: Invalid value: Must have port for Service reference")
    if total_matches > 128:
        e.append(
            "spec.rules: Invalid value: While 16 rules and 64 matches per rule are allowed, the total number of "
            "matches across all rules in a route must be less than 128"
        )
    return e


def _objective_invalid(spec: dict[str, Any]) -> list[str]:
    e = _Errors()
    ref = spec.get("poolRef")
    if not isinstance(ref, dict):
        return ["spec.poolRef: Required value"]
    if "name" not in ref:
        e.append("spec.poolRef.name: Required value")
    else:
        e.string("spec.poolRef.name", ref["name"], min_length=1, max_length=253)
    if "group" in ref:
        e.string("spec.poolRef.group", ref["group"], pattern=_GROUP, max_length=253)
    if "kind" in ref:
        e.string("spec.poolRef.kind", ref["kind"], pattern=_KIND, min_length=1, max_length=63)
    priority = spec.get("priority", 0)
    if isinstance(priority, float):
        e.append(
            'spec.priority: Invalid value: "number": spec.priority in body must be of type integer: "number"'
        )
    return e


def _name_errors(obj: dict[str, Any]) -> list[str]:
    name = str((obj.get("metadata") or {}).get("name") or "")
    sub = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    if len(name) > 253 or not re.match(sub, name):
        return [f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist of ..."]
    return []


def gateway_invalid(obj: dict[str, Any]) -> list[str]:
    """The 422 field errors for an InferencePool or HTTPRoute (empty: valid)."""
    spec = obj.get("spec") or {}
    errors = _name_errors(obj)
    if obj.get("kind") == "InferencePool":
        if obj.get("apiVersion") != "inference.networking.k8s.io/v1":
            errors.append(f"apiVersion: {obj.get('apiVersion')!r} is not the GA version")
        errors += _pool_invalid(spec)
    elif obj.get("kind") == "HTTPRoute":
        errors += _route_invalid(spec)
    elif obj.get("kind") == "InferenceObjective":
        errors += _objective_invalid(spec)
    return errors


def gateway_undeclared(obj: dict[str, Any]) -> list[str]:
    """Paths (`.spec.foo`) of fields the CRD's schema does not declare, where the operator writes."""
    spec = obj.get("spec") or {}
    out: list[str] = []
    if obj.get("kind") == "InferencePool":
        out += _undeclared(spec, _POOL_SPEC, ".spec")
        out += _undeclared(spec.get("selector"), {"matchLabels"}, ".spec.selector")
        ref = spec.get("endpointPickerRef")
        out += _undeclared(ref, _EPP_REF, ".spec.endpointPickerRef")
        out += _undeclared((ref or {}).get("port"), {"number"}, ".spec.endpointPickerRef.port")
        for i, port in enumerate(spec.get("targetPorts") or []):
            out += _undeclared(port, {"number"}, f".spec.targetPorts[{i}]")
    elif obj.get("kind") == "HTTPRoute":
        out += _undeclared(spec, _ROUTE_SPEC, ".spec")
        for i, ref in enumerate(spec.get("parentRefs") or []):
            out += _undeclared(ref, _PARENT_REF, f".spec.parentRefs[{i}]")
        for i, rule in enumerate(spec.get("rules") or []):
            out += _undeclared(rule, _ROUTE_RULE, f".spec.rules[{i}]")
            for j, match in enumerate((rule or {}).get("matches") or []):
                out += _undeclared(match, _MATCH, f".spec.rules[{i}].matches[{j}]")
                out += _undeclared(
                    (match or {}).get("path"), {"type", "value"}, f".spec.rules[{i}].matches[{j}].path"
                )
            for j, ref in enumerate((rule or {}).get("backendRefs") or []):
                out += _undeclared(ref, _BACKEND_REF, f".spec.rules[{i}].backendRefs[{j}]")
    elif obj.get("kind") == "InferenceObjective":
        out += _undeclared(spec, {"poolRef", "priority"}, ".spec")
        out += _undeclared(spec.get("poolRef"), {"group", "kind", "name"}, ".spec.poolRef")
        if isinstance(spec.get("priority"), str):  # the typed conversion refuses it before validation
            out.append(".spec.priority: expected numeric (int or float), got string")
    return out


def gateway_api_errors(obj: dict[str, Any]) -> list[str]:
    """Everything a server-side apply of the object would be refused for (empty: accepted)."""
    undeclared = gateway_undeclared(obj)
    return gateway_invalid(obj) + [
        p if ": " in p else f"{p}: field not declared in schema" for p in undeclared
    ]
