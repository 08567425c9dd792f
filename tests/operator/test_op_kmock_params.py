"""kmock refuses query parameters and bodies the way kube-apiserver v1.36.2 refused them (issue 29 F3):
the responses below were seen on that server."""

from __future__ import annotations

from kmock_params import body_error, query_error


def test_integer_query_parameters_are_parsed_like_strconv_parseint() -> None:
    for params, bad in (
        ({"watch": "true", "timeoutSeconds": "60.0"}, "60.0"),
        ({"limit": "5.0"}, "5.0"),
        ({"limit": "abc"}, "abc"),
        ({"gracePeriodSeconds": "1.5"}, "1.5"),
    ):
        refused = query_error(params)
        assert refused is not None and (refused.status, refused.reason) == (400, "BadRequest")
        assert refused.message == f'strconv.ParseInt: parsing "{bad}": invalid syntax'
    assert query_error({"watch": "true", "timeoutSeconds": "60", "limit": "5"}) is None
    assert query_error({"watch": "yes", "allowWatchBookmarks": "1"}) is None  # booleans are lenient


def test_a_float_in_a_builtin_json_body_is_a_bad_request() -> None:
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l"},
        "spec": {"holderIdentity": "x", "leaseDurationSeconds": 15.0},
    }
    refused = body_error("POST", "application/json", "coordination.k8s.io", lease)
    assert refused is not None and (refused.status, refused.reason) == (400, "BadRequest")
    assert str(refused.message).startswith(
        'Lease in version "v1" cannot be handled as a Lease: json: cannot unmarshal number 15.0'
    )
    lease["spec"]["leaseDurationSeconds"] = 15
    assert body_error("PUT", "application/json", "coordination.k8s.io", lease) is None
    # A server-side apply of `replicas: 2.0` was accepted; custom resources follow their schema.
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"replicas": 2.0}}
    assert body_error("PATCH", "application/apply-patch+yaml", "apps", deployment) is None
    assert body_error("POST", "application/json", "kubeinfer.dev", {"spec": {"target": 0.8}}) is None
