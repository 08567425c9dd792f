"""kmock refuses query parameters and bodies the way kube-apiserver v1.36.2 refused them (issue 29 F3):
the responses below were seen on that server."""

from __future__ import annotations

from kmock_params import body_error, is_true, options_error, query_error


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
    assert query_error({"watch": "true", "allowWatchBookmarks": "yes"}) is None  # booleans are lenient


def test_booleans_are_false_only_for_0_and_false() -> None:
    # v1.36.2: watch=0, false, FALSE list; watch=f, F, no and an empty value start a watch.
    assert [is_true(v) for v in ("0", "false", "FALSE", "False")] == [False] * 4
    assert [is_true(v) for v in ("f", "F", "no", "", "maybe", "1", "true")] == [True] * 7
    for spelling in ("f", "no", "1", ""):  # a watch kmock would serve as a list: refused, never misread
        refused = query_error({"watch": spelling})
        assert refused is not None and refused.status == 400
    assert query_error({"watch": "false"}) is None and query_error({"watch": "0"}) is None


def _refusal(refused: object) -> tuple[int, str, str]:
    assert refused is not None
    return refused.status, refused.reason, str(refused.message)  # type: ignore[attr-defined]


def test_resource_version_junk_is_400_on_a_list_and_500_on_a_watch() -> None:
    junk = 'resourceVersion: Invalid value: "junk": strconv.ParseUint: parsing "junk": invalid syntax'
    list_rv = options_error("GET", {"resourceVersion": "junk"}, "", "", None, collection=True)
    assert _refusal(list_rv) == (400, "BadRequest", f"invalid resource version: {junk}")
    watch = {"watch": "true", "resourceVersion": "1.5"}
    assert _refusal(options_error("GET", watch, "", "", None, collection=True)) == (
        500,
        "",
        'resourceVersion: Invalid value: "1.5": strconv.ParseUint: parsing "1.5": invalid syntax',
    )
    for ok in ("0", "", "251"):
        assert (
            options_error("GET", {"watch": "true", "resourceVersion": ok}, "", "", None, collection=True)
            is None
        )


def test_patch_and_write_options_as_the_api_server_checks_them() -> None:
    apply = "application/apply-patch+yaml"
    merge = "application/merge-patch+json"
    cases = [
        (
            ("PATCH", {"force": "true"}, apply),
            "PatchOptions",
            "fieldManager: Required value: is required for apply patch",
        ),
        (
            ("PATCH", {"fieldManager": "m" * 129}, apply),
            "PatchOptions",
            "fieldManager: Too long: may not be more than 128 bytes",
        ),
        (
            ("POST", {"fieldManager": "m" * 129}, "application/json"),
            "CreateOptions",
            "fieldManager: Too long: may not be more than 128 bytes",
        ),
        (
            ("PATCH", {"fieldManager": "m", "force": "true"}, merge),
            "PatchOptions",
            "force: Forbidden: may not be specified for non-apply patch",
        ),
        (
            ("POST", {"dryRun": "Junk"}, "application/json"),
            "CreateOptions",
            'dryRun: Unsupported value: ["Junk"]: supported values: "All"',
        ),
        (
            ("POST", {"fieldValidation": "Junk"}, "application/json"),
            "CreateOptions",
            'fieldValidation: Unsupported value: "Junk": supported values: "", "Ignore", "Strict", "Warn"',
        ),
        (
            ("DELETE", {"propagationPolicy": "Junk"}, ""),
            "DeleteOptions",
            'propagationPolicy: Unsupported value: "Junk": supported values: "Foreground", "Background", "Orphan", "nil"',
        ),
    ]
    for (method, params, content_type), options, detail in cases:
        refused = options_error(method, params, content_type, "", None, collection=False)
        assert _refusal(refused) == (422, "Invalid", f'{options}.meta.k8s.io "" is invalid: {detail}')
    # What the operator sends (k8s.py): accepted.
    assert (
        options_error("PATCH", {"fieldManager": "m" * 128, "force": "yes"}, apply, "", None, collection=False)
        is None
    )
    assert (
        options_error(
            "POST", {"fieldManager": "kubeinfer-operator"}, "application/json", "", None, collection=False
        )
        is None
    )
    delete_body: dict[str, str] = {"kind": "DeleteOptions", "propagationPolicy": "Background"}
    assert options_error("DELETE", {}, "", "apps", delete_body, collection=False) is None
    delete_body["propagationPolicy"] = "background"
    assert options_error("DELETE", {}, "", "apps", delete_body, collection=False) is not None


def test_a_strategic_merge_patch_of_a_custom_resource_is_415() -> None:
    strategic = "application/strategic-merge-patch+json"
    refused = options_error("PATCH", {}, strategic, "kubeinfer.dev", {}, collection=False)
    assert _refusal(refused) == (
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
    )
    assert options_error("PATCH", {}, strategic, "", {}, collection=False) is None  # a ConfigMap: fine
    assert options_error("PATCH", {}, strategic, "apps", {}, collection=False) is None


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
