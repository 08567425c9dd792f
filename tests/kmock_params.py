"""Query parameters as the API server parses them, for both kmock subclasses (tests/operator/op_cluster.py
and tests/deploy/deploy_helpers.py; tests/ is on sys.path).

kmock accepts any query string; the API server decodes ListOptions, DeleteOptions and friends with
k8s.io/apimachinery's query-parameter conversion, where an integer field goes through strconv.ParseInt.
A float such as kopf's `timeoutSeconds=60.0` (a resync period read through `float()`) is refused with
HTTP 400 BadRequest and the bare strconv message: seen on a real kube-apiserver v1.36.2 (issue 29, F3):
`strconv.ParseInt: parsing "60.0": invalid syntax`. Boolean parameters are parsed leniently there
(anything but 0/f/false is true), so only the integer ones are checked here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kmock import KubernetesError

# The int64 fields of ListOptions (timeoutSeconds, limit) and DeleteOptions (gracePeriodSeconds).
INTEGER_PARAMS = ("timeoutSeconds", "limit", "gracePeriodSeconds")
_INT64 = re.compile(r"^[+-]?[0-9]+$")  # what strconv.ParseInt(s, 10, 64) accepts (range aside)


def query_error(params: Mapping[str, str]) -> KubernetesError | None:
    """The API server's 400 for the first integer parameter that strconv.ParseInt refuses, else None."""
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
