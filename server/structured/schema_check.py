"""JSON-schema keywords xgrammar 0.2.9 cannot enforce: refused by name before compiling, never dropped.

xgrammar's JSON-schema converter builds a grammar from the keywords it knows and silently ignores the
rest, and some combinations of keywords it knows (a string's `pattern` with `maxLength`, `format` with
either, `enum` with anything but `type`, numeric or string bounds on a schema without that `type`,
`allOf` of several schemas, `oneOf` read as `anyOf`, siblings of
`$ref`). Each was found by compiling a schema and checking whether the grammar rejects an instance
that violates the keyword (tests/engine/test_engine_schema_keywords.py keeps that table and fails when
an xgrammar upgrade changes it). `check_schema` walks a schema and raises `SchemaNotEnforceable` naming
the first keyword (and its JSON pointer) the grammar would not enforce; what it accepts is enforced.
"""

from __future__ import annotations

from typing import Any


class SchemaNotEnforceable(ValueError):
    """A keyword (or combination) the grammar backend would ignore. The message names it."""


# Keywords that constrain nothing (annotations), accepted anywhere; `x-...` vendor keys likewise.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "examples",
        "default",
        "$comment",
        "$schema",
        "$id",
        "$anchor",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",  # OpenAPI's, pydantic writes it with oneOf; the oneOf rule below still applies
    }
)
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
# Enforced by xgrammar 0.2.9 (each alone, and in any combination not refused below).
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        *STRING_KEYWORDS,
        *NUMBER_KEYWORDS,
    }
)
# `format` values the grammar enforces; any other value would be ignored.
FORMATS = frozenset(
    {"email", "date", "date-time", "time", "uuid", "ipv4", "ipv6", "hostname", "uri", "duration"}
)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _refuse(path: str, what: str) -> SchemaNotEnforceable:
    return SchemaNotEnforceable(
        f"{what} at {path or '#'} cannot be enforced by the grammar backend (xgrammar)"
    )


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _resolve(root: Any, node: Any) -> Any:
    """A local `$ref` (#/$defs/x, #/definitions/x) followed once per hop; anything else as given."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 32:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, seen = target, seen + 1
    return node


def _disjoint(root: Any, branches: list[Any]) -> bool:
    """True when no instance can match two branches: pairwise disjoint `type`s, or objects whose
    shared required property has pairwise disjoint `const`/`enum` values (a discriminator)."""
    nodes = [_resolve(root, b) for b in branches]
    if not all(isinstance(n, dict) for n in nodes):
        return False
    types = [_types(n) for n in nodes]
    if all(types) and all(types[i].isdisjoint(types[j]) for i in range(len(nodes)) for j in range(i)):
        return True
    common = set.intersection(*(set(n.get("required") or []) for n in nodes)) if nodes else set()
    for key in sorted(common):
        values: list[set[str]] = []
        for n in nodes:
            prop = _resolve(root, (n.get("properties") or {}).get(key))
            if not isinstance(prop, dict):
                break
            vals = [prop["const"]] if "const" in prop else prop.get("enum")
            if not isinstance(vals, list):
                break
            values.append({repr(v) for v in vals})
        else:
            if all(values[i].isdisjoint(values[j]) for i in range(len(values)) for j in range(i)):
                return True
    return False


def check_schema(schema: Any) -> None:
    """Raises SchemaNotEnforceable naming the first keyword of `schema` (a JSON schema: dict or
    bool) that xgrammar 0.2.9 would not enforce; returns None when every keyword is enforced."""
    _check(schema, schema, "")


def _check(root: Any, node: Any, path: str) -> None:
    if isinstance(node, bool) or not isinstance(node, dict):
        return  # true/false schemas; a non-object is xgrammar's own error to report
    for key in node:
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in ENFORCED:
            raise _refuse(path, f"keyword '{key}'")
    keys = set(node) - ANNOTATIONS
    types = _types(node)
    if "$ref" in node:
        extra = sorted(
            k for k in keys if k not in ("$ref", "$defs", "definitions") and not k.startswith("x-")
        )
        if extra:
            raise _refuse(path, f"keyword '{extra[0]}' beside '$ref'")
    for choice in ("enum", "const"):
        if choice in node:
            extra = sorted(k for k in keys if k not in (choice, "type", "$defs", "definitions"))
            if extra:
                raise _refuse(path, f"keyword '{extra[0]}' with '{choice}'")
            values = node[choice] if choice == "enum" else [node[choice]]
            if types and isinstance(values, list):
                for v in values:
                    if not any(_JSON_TYPES.get(t, lambda _: True)(v) for t in types):
                        raise _refuse(path, f"'{choice}' value {v!r} outside 'type' {sorted(types)}")
    string_kw = sorted(keys & STRING_KEYWORDS)
    if string_kw and "string" not in types:
        raise _refuse(path, f'keyword \'{string_kw[0]}\' without "type": "string"')
    number_kw = sorted(keys & NUMBER_KEYWORDS)
    if number_kw and not types & {"integer", "number"}:
        raise _refuse(path, f'keyword \'{number_kw[0]}\' without "type": "integer" or "number"')
    if "pattern" in node:
        for other in ("minLength", "maxLength"):
            if other in node:
                raise _refuse(path, f"keyword '{other}' with 'pattern'")
    if "format" in node:
        if node["format"] not in FORMATS:
            raise _refuse(path, f"'format': {node['format']!r} (enforced: {', '.join(sorted(FORMATS))})")
        for other in ("pattern", "minLength", "maxLength"):
            if other in node:
                raise _refuse(path, f"keyword '{other}' with 'format'")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise _refuse(path, "keyword 'allOf' with more than one schema")
    if isinstance(node.get("oneOf"), list) and not _disjoint(root, node["oneOf"]):
        raise _refuse(path, "keyword 'oneOf' whose schemas may overlap (it is enforced as 'anyOf')")
    for key in _SUBSCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                _check(root, s, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                _check(root, s, f"{path}/{key}/{i}")
    for key in _SUBSCHEMAS:
        if key in node:
            _check(root, node[key], f"{path}/{key}")
