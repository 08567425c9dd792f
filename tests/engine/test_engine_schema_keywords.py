"""Every JSON-schema keyword is either enforced by the grammar or refused by name (issue 30 item 1).

The table holds, per keyword or combination, a schema, an instance valid under it and one that breaks
exactly that keyword (both checked with `jsonschema`). A row the server accepts (`check_schema`) must
be enforced: xgrammar's grammar accepts the valid instance and rejects the breaking one. A row it
refuses must name the keyword, and the grammar must indeed fail to enforce it (the breaking instance
passes, or a valid one is rejected): when an xgrammar upgrade starts enforcing a refused keyword, this
test fails and the refusal can go."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from server.structured.schema_check import SchemaNotEnforceable, check_schema


def S(**kw: Any) -> dict[str, Any]:
    return {"type": "string", **kw}


def I(**kw: Any) -> dict[str, Any]:  # noqa: E743
    return {"type": "integer", **kw}


def ARR(**kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer"}, **kw}


def OBJ(**kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, **kw}


DEFS = {"p": {"type": "integer", "maximum": 3}}
NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}
DISC = {
    "oneOf": [
        {
            "type": "object",
            "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
            "required": ["k", "x"],
        },
        {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
    ]
}

# (id, schema, valid instance, instance breaking the keyword, the keyword a refusal names or None)
ROWS: list[tuple[str, Any, Any, Any, str | None]] = [
    ("type", I(), 3, "x", None),
    ("type-list", {"type": ["integer", "null"]}, None, "x", None),
    ("enum", {"enum": ["a", "b"]}, "a", "c", None),
    ("const", {"const": "a"}, "a", "b", None),
    ("enum+type", {"type": "string", "enum": ["a", "b"]}, "a", "c", None),
    ("minLength", S(minLength=3), "abc", "ab", None),
    ("maxLength", S(maxLength=2), "ab", "abc", None),
    ("minLength+maxLength", S(minLength=2, maxLength=3), "ab", "abcd", None),
    ("pattern", S(pattern="^a+$"), "aa", "ab", None),
    ("format-email", S(format="email"), "a@b.co", "nope", None),
    ("format-date", S(format="date"), "2024-01-02", "nope", None),
    ("format-date-time", S(format="date-time"), "2024-01-02T03:04:05Z", "nope", None),
    ("format-time", S(format="time"), "03:04:05Z", "nope", None),
    ("format-uuid", S(format="uuid"), "123e4567-e89b-12d3-a456-426614174000", "nope", None),
    ("format-ipv4", S(format="ipv4"), "1.2.3.4", "nope", None),
    ("format-ipv6", S(format="ipv6"), "::1", "nope", None),
    ("format-hostname", S(format="hostname"), "a.com", "a b", None),
    ("format-uri", S(format="uri"), "http://a.com", "nope", None),
    ("format-duration", S(format="duration"), "P1D", "nope", None),
    ("minimum", I(minimum=3), 3, 2, None),
    ("maximum", I(maximum=3), 3, 4, None),
    ("exclusiveMinimum", I(exclusiveMinimum=3), 4, 3, None),
    ("exclusiveMaximum", I(exclusiveMaximum=3), 2, 3, None),
    ("number-minimum", {"type": "number", "minimum": 1.5}, 2.0, 1.0, None),
    ("number-exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, 1.0, 1.5, None),
    ("type-list+minimum", {"type": ["integer", "string"], "minimum": 3}, 3, 2, None),
    ("minItems", ARR(minItems=2), [1, 2], [1], None),
    ("maxItems", ARR(maxItems=1), [1], [1, 2], None),
    ("prefixItems", {"type": "array", "prefixItems": [I(), S()], "items": False}, [1, "a"], ["a", 1], None),
    ("items-false", {"type": "array", "prefixItems": [I()], "items": False}, [1], [1, 2], None),
    (
        "unevaluatedItems",
        {"type": "array", "prefixItems": [I()], "unevaluatedItems": False},
        [1],
        [1, 2],
        None,
    ),
    ("required", OBJ(required=["a"]), {"a": 1}, {"b": 1}, None),
    ("additionalProperties-false", OBJ(additionalProperties=False), {"a": 1}, {"c": 1}, None),
    (
        "additionalProperties-schema",
        {"type": "object", "additionalProperties": I()},
        {"x": 1},
        {"x": "s"},
        None,
    ),
    ("unevaluatedProperties", OBJ(unevaluatedProperties=False), {"a": 1}, {"c": 1}, None),
    (
        "propertyNames",
        {"type": "object", "propertyNames": S(pattern="^x"), "additionalProperties": I()},
        {"x": 1},
        {"y": 1},
        None,
    ),
    (
        "minProperties",
        {"type": "object", "additionalProperties": I(), "minProperties": 2},
        {"a": 1, "b": 2},
        {"a": 1},
        None,
    ),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": I(), "maxProperties": 1},
        {"a": 1},
        {"a": 1, "b": 2},
        None,
    ),
    ("anyOf", {"anyOf": [I(), S(maxLength=1)]}, 3, "ab", None),
    ("allOf-single", {"allOf": [I(maximum=3)]}, 3, 4, None),
    ("oneOf-disjoint-types", {"oneOf": [I(), S()]}, 3, True, None),
    ("oneOf-discriminator", DISC, {"k": "a", "x": 1}, {"k": "a"}, None),
    ("$ref", {"$defs": DEFS, "$ref": "#/$defs/p"}, 3, 4, None),
    ("$ref+description", {"$defs": DEFS, "$ref": "#/$defs/p", "description": "d"}, 3, 4, None),
    ("$ref-cycle", {"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, {"next": {}}, {"next": 1}, None),
    # refused: the grammar would not enforce these
    ("pattern+maxLength", S(pattern="^a+$", maxLength=2), "aa", "aaaa", "maxLength"),
    ("pattern+minLength", S(pattern="^a+$", minLength=3), "aaa", "a", "minLength"),
    (
        "nested-pattern+maxLength",
        {"type": "array", "items": S(pattern="^a+$", maxLength=2)},
        ["aa"],
        ["aaa"],
        "maxLength",
    ),
    ("format+maxLength", S(format="email", maxLength=6), "a@b.co", "abcd@efgh.com", "maxLength"),
    ("format+pattern", S(format="email", pattern="^x"), "x@b.co", "a@b.co", "pattern"),
    ("format-unknown", S(format="ipv4-cidr"), "1.2.3.4/8", "nope", "format"),
    ("maxLength-without-type", {"maxLength": 2}, "ab", "abc", "maxLength"),
    ("pattern-without-type", {"pattern": "^a$"}, "a", "b", "pattern"),
    ("minimum-without-type", {"minimum": 3}, 3, 2, "minimum"),
    ("multipleOf", I(minimum=0, multipleOf=5), 15, 3, "multipleOf"),
    ("number-multipleOf", {"type": "number", "multipleOf": 0.5}, 1.5, 1.2, "multipleOf"),
    ("uniqueItems", ARR(uniqueItems=True), [1, 2], [1, 1], "uniqueItems"),
    ("contains", ARR(contains={"const": 5}), [5], [1], "contains"),
    ("maxContains", ARR(contains={"const": 5}, maxContains=1), [5], [5, 5], "contains"),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^x": I()}},
        {"x1": 1},
        {"x1": "s"},
        "patternProperties",
    ),
    (
        "dependentRequired",
        OBJ(dependentRequired={"a": ["b"]}),
        {"a": 1, "b": 2},
        {"a": 1},
        "dependentRequired",
    ),
    (
        "dependencies",  # draft 7's name for dependentRequired/dependentSchemas
        OBJ(dependencies={"a": ["b"]}, **{"$schema": "http://json-schema.org/draft-07/schema#"}),
        {"a": 1, "b": 2},
        {"a": 1},
        "dependencies",
    ),
    (
        "dependentSchemas",
        OBJ(dependentSchemas={"a": {"required": ["b"]}}),
        {"a": 1, "b": 2},
        {"a": 1},
        "dependentSchemas",
    ),
    ("not", I(**{"not": {"const": 3}}), 2, 3, "not"),
    ("if-then-else", I(**{"if": {"minimum": 5}, "then": {"maximum": 7}, "else": {"maximum": 2}}), 6, 4, "if"),
    ("allOf-several", {"allOf": [I(), {"minimum": 3}]}, 4, 2, "allOf"),
    ("oneOf-overlapping", {"oneOf": [I(minimum=0), I(maximum=5)]}, 7, 3, "oneOf"),
    ("$ref+maximum", {"$defs": {"p": I()}, "$ref": "#/$defs/p", "maximum": 3}, 3, 4, "maximum"),
    ("enum+maxLength", {"type": "string", "enum": ["aaa", "b"], "maxLength": 1}, "b", "aaa", "maxLength"),
    ("enum+minimum", I(enum=[1, 5], minimum=3), 5, 1, "minimum"),
    ("enum-outside-type", {"type": "string", "enum": ["a", 1]}, "a", 1, "enum"),
    ("contentEncoding", S(contentEncoding="base64"), "YQ==", "!!", "contentEncoding"),
]


# What jsonschema itself does not check (annotations in 2020-12, or formats without a checker installed):
# for these the breaking instance breaks the keyword's meaning, not jsonschema's validation.
UNCHECKED_KEYWORDS = {"contentEncoding"}


def _jsonschema_breaks(schema: dict[str, Any], instance: Any) -> bool | None:
    """Whether jsonschema (with format checks) rejects the instance; None where it cannot tell."""
    cls = jsonschema.validators.validator_for(schema)
    checker = cls.FORMAT_CHECKER
    fmt = schema.get("format")
    if (fmt is not None and fmt not in checker.checkers) or UNCHECKED_KEYWORDS & set(schema):
        return None
    return not cls(schema, format_checker=checker).is_valid(instance)


def _grammar_accepts(schema: Any, instance: Any) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return bool(_is_grammar_accept_string(grammar, json.dumps(instance, ensure_ascii=False)))


@pytest.mark.parametrize(
    ("schema", "good", "bad", "refused"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_schema_keyword_enforced_or_refused(schema: Any, good: Any, bad: Any, refused: str | None) -> None:
    if isinstance(schema, dict):
        assert _jsonschema_breaks(schema, good) in (False, None)
        assert _jsonschema_breaks(schema, bad) in (True, None)
    if refused is None:
        check_schema(schema)
        assert _grammar_accepts(schema, good)
        assert not _grammar_accepts(schema, bad)
        return
    with pytest.raises(SchemaNotEnforceable, match=refused):
        check_schema(schema)
    # ...and the refusal is needed: xgrammar lets the breaking instance through (or a valid one not).
    assert not _grammar_accepts(schema, good) or _grammar_accepts(schema, bad)
