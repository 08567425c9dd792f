"""The status subresource's split and fieldValidation's three modes, as kube-apiserver does them, for
the kmock API server (op_cluster.ApiServer), which stored whatever a write carried.

Seen on kube-apiserver v1.36.2 (/work/kube-build, issue 44 item 4; docs/operator.md "What the mock
API server reproduces"), on our InferenceModel CRD and on a Deployment and a Service:
- a create (POST) drops `status`: a custom resource's is absent, a Deployment's is `{}`, a Service's
  is `{"loadBalancer": {}}`;
- a write to `/status` (merge patch or PUT) changes status only: a changed `spec` or label is ignored;
- an undeclared field with `fieldValidation=Strict`: a create or replace is `400 BadRequest
  <Kind> in version "<v>" cannot be handled as a <Kind>: strict decoding error: unknown field
  "spec.bogus"`, a patch `422 Invalid ... strict decoding error: unknown field "spec.bogus"`;
  with `Warn` (also the default, the parameter unset) it is pruned and each field gets a
  `Warning: 299 - "unknown field \\"spec.bogus\\""` header; with `Ignore` it is pruned silently;
  a server-side apply is refused with 500 whatever the mode (kmock_pruning.py).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from kmock import KubernetesError

# What a create leaves in status, by kind; a kind not listed (a custom resource) has no status.
STATUS_AFTER_CREATE: dict[str, dict[str, Any]] = {
    "Deployment": {},
    "Service": {"loadBalancer": {}},
}
# The kinds whose create was seen to drop status (Pods, Jobs and claims were not probed: kept as sent).
STATUS_DROPPED_ON_CREATE = frozenset({"InferenceModel", *STATUS_AFTER_CREATE})


def drop_status_on_create(kind: str, data: dict[str, Any]) -> None:
    """Replace, in place, the status a create (or an apply that creates) carries by what the API
    server keeps of it."""
    if kind not in STATUS_DROPPED_ON_CREATE:
        return
    data.pop("status", None)
    if kind in STATUS_AFTER_CREATE:
        data["status"] = copy.deepcopy(STATUS_AFTER_CREATE[kind])


def status_patch(data: dict[str, Any]) -> dict[str, Any]:
    """A merge patch to `/status` as the API server applies it: its status (and the resourceVersion
    that guards it) only."""
    kept: dict[str, Any] = {k: data[k] for k in ("apiVersion", "kind", "status") if k in data}
    version = (data.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        kept["metadata"] = {"resourceVersion": version}
    return kept


def status_replace(data: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A PUT to `/status` as the API server applies it: the live object with the body's status; the
    body's resourceVersion is kept for the replace's conflict check."""
    body = copy.deepcopy(live)
    body["status"] = copy.deepcopy(data.get("status"))
    if body["status"] is None:
        body.pop("status")
    version = (data.get("metadata") or {}).get("resourceVersion")
    meta = body.setdefault("metadata", {})
    if version is not None:
        meta["resourceVersion"] = version
    else:
        meta.pop("resourceVersion", None)
    return body


def unknown_field_names(paths: list[str]) -> list[str]:
    """Server-side apply's paths (`.spec.bogus`) as fieldValidation names them (`spec.bogus`)."""
    return [p[1:] if p.startswith(".") else p for p in paths]


def field_validation(
    mode: str | None,
    undeclared: list[str],
    *,
    kind: str,
    version: str,
    patch: bool,
    body: dict[str, Any],
) -> list[str]:
    """Apply `fieldValidation` (None: unset, which is Warn) to a write whose undeclared fields, already
    pruned, are `undeclared` (apply-style paths). Returns the Warning header values to send.

    Raises KubernetesError: 400 for a create or replace under Strict, 422 for a patch under Strict."""
    if not undeclared or mode == "Ignore":
        return []
    names = unknown_field_names(undeclared)
    listed = ", ".join(f'unknown field "{n}"' for n in names)
    if mode == "Strict":
        if patch:
            raise KubernetesError(
                status=422,
                reason="Invalid",
                message=f' "" is invalid: patch: Invalid value: {json.dumps(json.dumps(body))}: '
                f"strict decoding error: {listed}",
            )
        raise KubernetesError(
            status=400,
            reason="BadRequest",
            message=f'{kind} in version "{version}" cannot be handled as a {kind}: '
            f"strict decoding error: {listed}",
        )
    return ["299 - " + json.dumps(f'unknown field "{n}"') for n in names]
