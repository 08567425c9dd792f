"""The mock API server's watch as kube-apiserver serves it (kmock_watch.py): every write gives the object
a new resourceVersion, a watch from a version replays exactly the events after it (nothing for what did
not change), one without a version starts with every object as ADDED, and a version older than what is
kept is answered 410 Expired. kmock alone answered every watch with the objects that existed, so a
deletion between two of kopf's streams was lost (CI, stop 58). Each behaviour was seen on kube-apiserver
v1.36.2 with embedded etcd 3.6.8 (docs/operator.md "What the tests stand in for")."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import kmock_watch
import pytest
from op_cluster import PATHS, MockCluster

CM = PATHS["ConfigMap"].format(ns="default")


def config_map(name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def watch(cluster: MockCluster, query: str) -> list[dict[str, Any]]:
    """The events of one watch stream that the server ends after 1 s."""
    url = f"{cluster.url}{CM}?watch=true&timeoutSeconds=1{query}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return [json.loads(line) for line in resp.read().splitlines() if line.strip()]


def version(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


def summary(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"]["name"]) for e in events]


def test_every_write_gives_a_new_larger_resource_version(cluster: MockCluster) -> None:
    created = cluster.create("ConfigMap", config_map("a", k="1"))
    patched = cluster.patch("ConfigMap", "a", {"data": {"k": "2"}})
    relabelled = cluster.patch("ConfigMap", "a", {"metadata": {"labels": {"x": "y"}}})
    assert version(created) < version(patched) < version(relabelled)
    assert (
        cluster.get("ConfigMap", "a")["metadata"]["resourceVersion"]
        == relabelled["metadata"]["resourceVersion"]
    )  # type: ignore[index]


def test_a_watch_from_a_version_replays_what_happened_after_it(cluster: MockCluster) -> None:
    cluster.create("ConfigMap", config_map("untouched"))
    cluster.create("ConfigMap", config_map("a"))
    listed = cluster.request("GET", CM)["metadata"]["resourceVersion"]
    # No watch open while these happen.
    cluster.create("ConfigMap", config_map("b"))
    last_a = cluster.patch("ConfigMap", "a", {"data": {"k": "2"}})
    cluster.delete("ConfigMap", "b")
    cluster.delete("ConfigMap", "a")
    events = watch(cluster, f"&resourceVersion={listed}")
    assert summary(events) == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b"), ("DELETED", "a")]
    versions = [version(e["object"]) for e in events]
    assert versions == sorted(set(versions))  # each event its own version, in order
    assert versions[-1] > version(last_a)  # the deletion is a write of its own
    # Resumed from the third event: only the fourth.
    assert summary(watch(cluster, f"&resourceVersion={versions[2]}")) == [("DELETED", "a")]


@pytest.mark.parametrize("query", ["", "&resourceVersion=0"])
def test_a_watch_without_a_version_starts_with_every_object(cluster: MockCluster, query: str) -> None:
    cluster.create("ConfigMap", config_map("a"))
    cluster.create("ConfigMap", config_map("b"))
    cluster.delete("ConfigMap", "b")
    assert summary(watch(cluster, query)) == [("ADDED", "a")]


def test_a_version_older_than_what_is_kept_is_expired(
    monkeypatch: pytest.MonkeyPatch, cluster_factory: Any
) -> None:
    monkeypatch.setattr(kmock_watch, "HISTORY", 3)
    cluster = cluster_factory()
    first = version(cluster.create("ConfigMap", config_map("a")))
    for i in range(4):
        cluster.patch("ConfigMap", "a", {"data": {"k": str(i)}})
    events = watch(cluster, f"&resourceVersion={first}")
    assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [
        ("ERROR", 410, "Expired")
    ]
    oldest = version(cluster.get("ConfigMap", "a")) - 3  # the 3 newest events are kept
    assert events[0]["object"]["message"] == f"too old resource version: {first} ({oldest})"
    assert summary(watch(cluster, f"&resourceVersion={oldest}")) == [("MODIFIED", "a")] * 3


def test_a_patch_that_changes_nothing_writes_nothing(cluster: MockCluster) -> None:
    """v1.36.2 answered a repeated patch 200 with the version the object had, and its watchers got
    nothing; kmock stored a new version and sent MODIFIED."""
    cluster.create("ConfigMap", config_map("a", k="1"))
    listed = cluster.request("GET", CM)["metadata"]["resourceVersion"]
    before = cluster.get("ConfigMap", "a")
    again = cluster.patch("ConfigMap", "a", {"data": {"k": "1"}})
    assert again == before
    assert watch(cluster, f"&resourceVersion={listed}") == []


def test_a_patch_on_a_stale_version_is_refused(cluster: MockCluster) -> None:
    """kopf guards its finalizer changes with a JSON patch `test` on the resourceVersion, which every write
    now moves: v1.36.2 answered a failed test (or a missing path) 422 Invalid, which kopf retries at its
    next cycle (kmock answered 500, which kopf retries with backoff on the same stale version), and a merge
    patch carrying a stale resourceVersion 409 Conflict (kmock applied it)."""
    first = cluster.create("ConfigMap", config_map("a", k="1"))["metadata"]["resourceVersion"]
    second = cluster.patch("ConfigMap", "a", {"data": {"k": "2"}})["metadata"]["resourceVersion"]
    path, json_patch = f"{CM}/a", "application/json-patch+json"
    invalid = (422, "Invalid", "the server rejected our request due to an error in our request")
    for ops in (
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": first},
            {"op": "add", "path": "/data/x", "value": "1"},
        ],
        [{"op": "remove", "path": "/data/nope"}],
    ):
        code, _, answer = cluster.answer("PATCH", path, ops, content_type=json_patch)
        assert (code, answer["reason"], answer["message"]) == invalid
    code, _, answer = cluster.answer(
        "PATCH",
        path,
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": second},
            {"op": "replace", "path": "/data/k", "value": "3"},
        ],
        content_type=json_patch,
    )
    assert code == 200 and answer["data"] == {"k": "3"} and version(answer) > int(second)
    code, _, answer = cluster.answer(
        "PATCH",
        path,
        {"metadata": {"resourceVersion": first}, "data": {"k": "4"}},
        content_type="application/merge-patch+json",
    )
    assert (code, answer["reason"]) == (409, "Conflict")
    assert answer["message"] == (
        'Operation cannot be fulfilled on configmaps "a": the object has been modified; please apply your '
        "changes to the latest version and try again"
    )
    assert cluster.get("ConfigMap", "a")["data"] == {"k": "3"}  # type: ignore[index]


def test_a_replace_that_changes_nothing_writes_nothing(cluster: MockCluster) -> None:
    cluster.create("ConfigMap", config_map("a", k="1"))
    listed = cluster.request("GET", CM)["metadata"]["resourceVersion"]
    live = cluster.get("ConfigMap", "a")
    assert cluster.replace("ConfigMap", live) == live  # type: ignore[arg-type]
    assert watch(cluster, f"&resourceVersion={listed}") == []
