"""Structural-schema pruning as kube-apiserver does it to custom resources, for the kmock API server.

A real API server drops every field its CRD's schema does not declare, silently (with only a warning
header under the default fieldValidation=Warn), on every write: create, update, merge and apply patches,
on the main resource and on the status subresource alike; `x-kubernetes-preserve-unknown-fields: true`
keeps the unknown fields of its node (the declared ones below it are still pruned by their own schema).
A server-side apply is the exception: its typed patch refuses an undeclared field with a 500
(`failed to create typed patch object (...): .spec.foo: field not declared in schema`). kmock stored
whatever came, so an operator writing a status field the CRD lacks passed every mock test
and lost the field on a real cluster. The rules follow apiextensions-apiserver's
pkg/apiserver/schema/pruning/algorithm.go; test_op_kmock_pruning.py holds the verdicts seen on
kube-apiserver v1.36.2 that this reproduces.
"""

from __future__ import annotations

from typing import Any

# Never pruned at the root of a resource (the API server handles ObjectMeta itself).
ROOT_KEPT = ("apiVersion", "kind", "metadata")


def prune(value: Any, schema: dict[str, Any] | None, path: str = "") -> list[str]:
    """Delete, in place, what `schema` (a structural schema node; None: no schema, as under
    `additionalProperties: true`) does not declare in `value` (JSON: dicts, lists, scalars). Returns
    the deleted fields' paths as server-side apply names them (`.spec.foo`, `.status.conditions[0].x`)."""
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        return _keep_unknown(value, schema, path)
    removed: list[str] = []
    if isinstance(value, dict):
        for key in list(value):
            sub = _field_schema(schema, key)
            if sub is _UNDECLARED:
                del value[key]
                removed.append(f"{path}.{key}")
            else:
                removed += prune(value[key], sub, f"{path}.{key}")
    elif isinstance(value, list):
        items = schema.get("items") if schema is not None else None
        for i, item in enumerate(value):
            removed += prune(item, items, f"{path}[{i}]")
    return removed


def prune_resource(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Prune a whole object (or a merge/apply patch of one) by its CRD's openAPIV3Schema, in place;
    returns the deleted fields' paths."""
    removed: list[str] = []
    for key in list(obj):
        if key in ROOT_KEPT:
            continue
        sub = _field_schema(schema, key)
        if sub is _UNDECLARED:
            del obj[key]
            removed.append(f".{key}")
        else:
            removed += prune(obj[key], sub, f".{key}")
    return removed


_UNDECLARED: dict[str, Any] = {}


def _field_schema(schema: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The schema of `key` in an object node: its property, else additionalProperties (None when that
    is `true`: any value, itself pruned as schemaless), else _UNDECLARED."""
    if schema is None:
        return _UNDECLARED
    properties = schema.get("properties") or {}
    if key in properties:
        return properties[key]  # type: ignore[no-any-return]
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        return extra
    if extra is True:
        return None
    return _UNDECLARED


def _keep_unknown(value: Any, schema: dict[str, Any] | None, path: str) -> list[str]:
    """Under x-kubernetes-preserve-unknown-fields: unknown fields stay, declared ones are pruned by their
    own schema."""
    removed: list[str] = []
    if isinstance(value, dict):
        for key, sub_value in value.items():
            sub = _field_schema(schema, key)
            if sub is _UNDECLARED or sub is None:
                removed += _keep_unknown(sub_value, None, f"{path}.{key}")
            else:
                removed += prune(sub_value, sub, f"{path}.{key}")
    elif isinstance(value, list):
        items = schema.get("items") if schema is not None else None
        for i, item in enumerate(value):
            if items is None:
                removed += _keep_unknown(item, None, f"{path}[{i}]")
            else:
                removed += prune(item, items, f"{path}[{i}]")
    return removed
