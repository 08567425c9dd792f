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
