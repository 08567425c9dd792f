"""Every child object's name and every label value the operator renders is one the API server accepts,
whatever the InferenceModel is called: an InferenceModel may have any DNS-1123 subdomain name (dots, up
to 253 characters), while a Service needs a DNS-1035 label and a label value 63 characters at most.

Found on kube-apiserver 1.36: `llama-3.1-8b` with `minReplicas: 0` failed at `llama-3.1-8b-activator`
(dots in a Service name), `qwen-2.5-routed-router` the same for the router, and a NetworkPolicy's
`matchLabels` value went over 63 bytes for a long name."""

from __future__ import annotations

from typing import Any

import pytest
from kubeinfer_operator.names import child_name, derived_name, is_dns1035_label
from kubeinfer_operator.render import render_all
from kubeinfer_operator.spec import InferenceModel
from op_apichecks import api_errors
from op_testlib import EXAMPLES, load_yaml

NAMES = {
    "dotted": "llama-3.1-8b",
    "leading-digit": "7b.chat",
    "63": "m" + "-x" * 31,
    "253": ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61]),
    "54": "q" * 54,
}
# Variants that add every optional child: the activator (minReplicas 0) and the router (spec.routing).
VARIANTS: dict[str, dict[str, Any]] = {
    "as-is": {},
    "zero-and-routed": {"scaling": {"minReplicas": 0, "replicas": 1}, "routing": {"enabled": True}},
}


def _label_maps(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every `labels`, `matchLabels` and Service `selector` map anywhere in an object."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            if key in ("labels", "matchLabels") and isinstance(value, dict):
                found.append((here, value))
            found += _label_maps(value, here)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found += _label_maps(item, f"{path}[{i}]")
    return found


def _objects(path_stem: str, doc: dict[str, Any], name: str, variant: dict[str, Any]) -> list[dict[str, Any]]:
    doc = {**doc, "metadata": {**doc["metadata"], "name": name, "uid": "u-1"}}
    spec = dict(doc["spec"])
    for key, value in variant.items():
        if key == "scaling" and (spec.get("scaling") or {}).get("autoscaler") == "HPA":
            continue  # HPA needs minReplicas >= 1 (admission refuses 0 there)
        if key == "routing" and (spec.get("parallelism") or {}).get("nodes", 1) > 1:
            continue
        if "canary" in spec:  # a canary is refused with scale to zero and vllm-router (its own children vary)
            continue
        spec[key] = {**(spec.get(key) or {}), **value}
    doc["spec"] = spec
    return render_all(InferenceModel.from_manifest(doc)).objects


CASES = [
    pytest.param(path, name, variant, id=f"{path.stem}-{nid}-{vid}")
    for path in EXAMPLES
    for nid, name in NAMES.items()
    for vid, variant in VARIANTS.items()
]


@pytest.mark.parametrize(("path", "name", "variant"), CASES)
def test_every_child_name_and_label_is_valid(path: Any, name: str, variant: dict[str, Any]) -> None:
    objects = _objects(path.stem, load_yaml(path), name, variant)
    assert objects
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        assert api_errors(obj) == [], (obj["kind"], obj["metadata"]["name"])
        for where, labels in _label_maps(obj):
            for key, value in labels.items():
                assert isinstance(value, str) and len(value) <= 63, (obj["kind"], where, key, value)
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in seen, key  # two children of one kind never share a name
        seen.add(key)
    if variant:
        kinds = {o["kind"] for o in objects}
        assert "Service" in kinds


def test_derived_names_are_short_distinct_and_stable() -> None:
    long_a, long_b = "a" * 62 + "x", "a" * 62 + "y"
    for base in ("llm", "llama-3.1-8b", long_a, "q" * 54):
        for suffix in ("activator", "router", "lws", "load-0123abcd"):
            name = derived_name(child_name(base), suffix)
            assert is_dns1035_label(name) and name.endswith(f"-{suffix}"), name
            assert name == derived_name(child_name(base), suffix)  # stable across calls
    # Two long names that share their first 54 characters still get distinct children.
    assert derived_name(child_name(long_a), "router") != derived_name(child_name(long_b), "router")
    # A short valid name keeps the readable form.
    assert derived_name("llm", "router") == "llm-router"
