"""Query parameters as the API server parses them, for both kmock subclasses (tests/operator/op_cluster.py
and tests/deploy/deploy_helpers.py; tests/ is on sys.path).

kmock accepts any query string; the API server decodes ListOptions, DeleteOptions and friends with
k8s.io/apimachinery's query-parameter conversion, where an integer field goes through strconv.ParseInt.
A float such as kopf's `timeoutSeconds=60.0` (a resync period read through `float()`) is refused with
HTTP 400 BadRequest and the bare strconv message: seen on a real kube-apiserver v1.36.2 (issue 29, F3):
`strconv.ParseInt: parsing "60.0": invalid syntax`. Boolean parameters are parsed leniently there:
only `0` and `false` (any case) are false, anything else (`f`, `no`, an empty value) is true
(apimachinery's Convert_Slice_string_To_bool; `watch=f` started a watch on v1.36.2). kmock starts a
watch only for `watch=true`, so any other true spelling of `watch` is refused here rather than served
as a list (the real server would have watched).

`options_error` checks the rest of what v1.36.2 refused in the query (every message verbatim from
that server, /work/k8s-real/FINDINGS.md of issue 29): a `resourceVersion` that is not an unsigned
integer (400 on a list, 500 on a watch), an apply patch without `fieldManager`, a `fieldManager` over
128 bytes, `force` on a non-apply patch, the enum options `dryRun`, `fieldValidation` and
`propagationPolicy` (422 `Unsupported value`), and a strategic merge patch of a custom resource (415).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kmock import KubernetesError

# The int64 fields of ListOptions (timeoutSeconds, limit) and DeleteOptions (gracePeriodSeconds).
INTEGER_PARAMS = ("timeoutSeconds", "limit", "gracePeriodSeconds")
_INT64 = re.compile(r"^[+-]?[0-9]+$")  # what strconv.ParseInt(s, 10, 64) accepts (range aside)
_UINT64 = re.compile(r"^[0-9]+$")  # what strconv.ParseUint(s, 10, 64) accepts (range aside)


def is_true(value: str) -> bool:
    """A boolean query parameter as the API server reads it: only "0" and "false" (any case) are false."""
    return value != "0" and value.lower() != "false"


def query_error(params: Mapping[str, str]) -> KubernetesError | None:
    """The API server's 400 for the first integer parameter that strconv.ParseInt refuses, else None
    (and kmock's 400 for a `watch` spelled other than `true` that the API server reads as true)."""
    watch = params.get("watch")
    if watch is not None and watch != "true" and is_true(watch):
        return KubernetesError(
            status=400,
            reason="BadRequest",
            message=f"kmock: watch={watch} starts a watch on the API server, kmock serves one only for "
            f"watch=true (only 0 and false, any case, are false)",
        )
    for name in INTEGER_PARAMS:
        value = params.get(name)
        if value is None:
            continue
        if not _INT64.match(value):
            return KubernetesError(
                status=400,
                reason="BadRequest",
                message=f'strconv.ParseInt: parsing "{value}": invalid syntax',
            )
        if not -(2**63) <= int(value) < 2**63:
            return KubernetesError(
                status=400,
                reason="BadRequest",
                message=f'strconv.ParseInt: parsing "{value}": value out of range',
            )
    return None


# Built-in API groups: their objects decode into Go structs, where no field is a float (API conventions)
# and an integer field refuses a JSON number with a fraction or a decimal point. Seen on v1.36.2 for a
# JSON create (a server-side apply of `replicas: 2.0` was accepted, so apply patches are left alone):
# `Lease in version "v1" cannot be handled as a Lease: json: cannot unmarshal number 15.0 into Go struct
# field LeaseSpec.spec.leaseDurationSeconds of type int32`.
BUILTIN_GROUPS = frozenset(
    {
        "",
        "apps",
        "batch",
        "policy",
        "autoscaling",
        "coordination.k8s.io",
        "networking.k8s.io",
        "rbac.authorization.k8s.io",
    }
)


def _first_float(value: object, path: str) -> tuple[str, float] | None:
    if isinstance(value, float):
        return path, value
    if isinstance(value, dict):
        for key, sub in value.items():
            found = _first_float(sub, f"{path}.{key}" if path else str(key))
            if found:
                return found
    if isinstance(value, list):
        for sub in value:
            found = _first_float(sub, path)
            if found:
                return found
    return None


def body_error(method: str, content_type: str, group: str | None, body: object) -> KubernetesError | None:
    """The API server's 400 for a JSON create/replace of a built-in object carrying a float, else None."""
    if method not in ("POST", "PUT") or "json" not in content_type or (group or "") not in BUILTIN_GROUPS:
        return None
    found = _first_float(body, "")
    if found is None or not isinstance(body, dict):
        return None
    path, value = found
    kind, version = body.get("kind", "object"), str(body.get("apiVersion", "")).rpartition("/")[2]
    return KubernetesError(
        status=400,
        reason="BadRequest",
        message=(
            f'{kind} in version "{version}" cannot be handled as a {kind}: json: cannot unmarshal number '
            f"{value!r} into Go struct field {path} of type int32"
        ),
    )


# The options struct each verb decodes its query into (the prefix of the API server's 422 messages).
_OPTIONS = {
    "POST": "CreateOptions",
    "PUT": "UpdateOptions",
    "PATCH": "PatchOptions",
    "DELETE": "DeleteOptions",
}
_FIELD_VALIDATION = ("", "Ignore", "Strict", "Warn")
_PROPAGATION = ("Foreground", "Background", "Orphan")


def _invalid(options: str, field: str, detail: str) -> KubernetesError:
    return KubernetesError(
        status=422, reason="Invalid", message=f'{options}.meta.k8s.io "" is invalid: {field}: {detail}'
    )


def _resource_version_error(value: str, watching: bool) -> KubernetesError | None:
    if value == "":
        return None
    if _UINT64.match(value):
        if int(value) < 2**64:
            return None
        cause = f'strconv.ParseUint: parsing "{value}": value out of range'
    else:
        cause = f'strconv.ParseUint: parsing "{value}": invalid syntax'
    invalid = f'resourceVersion: Invalid value: "{value}": {cause}'
    if watching:  # the watch cache's error, surfaced as an internal error
        return KubernetesError(status=500, reason="", message=invalid)
    return KubernetesError(status=400, reason="BadRequest", message=f"invalid resource version: {invalid}")


def is_custom_group(group: str | None) -> bool:
    """A CRD's API group: built-in groups are dot-free (apps, batch) or end in .k8s.io."""
    return bool(group) and "." in str(group) and not str(group).endswith(".k8s.io")


def options_error(
    method: str,
    params: Mapping[str, str],
    content_type: str,
    group: str | None,
    body: object,
    *,
    collection: bool,
) -> KubernetesError | None:
    """The API server's refusal of a request's options (query, and a DELETE's DeleteOptions body), else
    None. `method` is the HTTP method; `collection` is True for a list or watch (no object name)."""
    if method == "GET":
        if collection and "resourceVersion" in params:
            watching = "watch" in params and is_true(params["watch"])
            return _resource_version_error(params["resourceVersion"], watching)
        return None
    options = _OPTIONS.get(method)
    if options is None:
        return None
    apply = method == "PATCH" and "apply-patch" in content_type
    if method == "PATCH" and "strategic-merge-patch" in content_type and is_custom_group(group):
        return KubernetesError(
            status=415,
            reason="UnsupportedMediaType",
            message="the body of the request was in an unknown format - accepted media types include: "
            "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
        )
    if "dryRun" in params and params["dryRun"] != "All":
        return _invalid(
            options, "dryRun", f'Unsupported value: ["{params["dryRun"]}"]: supported values: "All"'
        )
    if method != "DELETE":
        manager = params.get("fieldManager")
        if apply and not manager:
            return _invalid(options, "fieldManager", "Required value: is required for apply patch")
        if manager is not None and len(manager.encode()) > 128:
            return _invalid(options, "fieldManager", "Too long: may not be more than 128 bytes")
        if "force" in params and not apply:
            return _invalid(options, "force", "Forbidden: may not be specified for non-apply patch")
        validation = params.get("fieldValidation")
        if validation is not None and validation not in _FIELD_VALIDATION:
            supported = ", ".join(f'"{v}"' for v in _FIELD_VALIDATION)
            return _invalid(
                options,
                "fieldValidation",
                f'Unsupported value: "{validation}": supported values: {supported}',
            )
        return None
    policy = params.get("propagationPolicy")
    if policy is None and isinstance(body, dict):
        policy = body.get("propagationPolicy")
    if policy is not None and policy not in _PROPAGATION:
        supported = ", ".join(f'"{v}"' for v in (*_PROPAGATION, "nil"))
        return _invalid(
            options, "propagationPolicy", f'Unsupported value: "{policy}": supported values: {supported}'
        )
    return None


def request_error(request: Any) -> KubernetesError | None:
    """What the API server refuses in a kmock request before serving it: its query parameters, then (for
    a resource) the body and the options; the one check both kmock subclasses run."""
    refused = query_error(request.params)
    if refused is None and request.resource is not None:
        method = str(getattr(request.method, "value", request.method)).upper()
        content_type = request.headers.get("Content-Type") or ""
        refused = body_error(method, content_type, request.resource.group, request.data)
        if refused is None:
            collection = request.resource.plural is not None and request.name is None
            refused = options_error(
                method,
                request.params,
                content_type,
                request.resource.group,
                request.data,
                collection=collection,
            )
    return refused
