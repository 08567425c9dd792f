"""The mock API server answers writes of the built-in kinds the operator writes as kube-apiserver v1.36.2
did: each case of kmock_builtin_answers.json (recorded on the real server, docs/operator.md "What the
tests stand in for") is replayed against kmock, which must give the same status code, reason, message
and causes' field paths, the same Warning headers, and store what the real server stored."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from op_cluster import BASE_RESOURCES, PATHS, MockCluster

ANSWERS: list[dict[str, Any]] = json.loads(
    (pathlib.Path(__file__).parent / "kmock_builtin_answers.json").read_text()
)["cases"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster(resources=dict(BASE_RESOURCES)).start()
    yield mock
    mock.stop()


@pytest.mark.parametrize("case", ANSWERS, ids=[c["case"] for c in ANSWERS])
def test_kmock_answers_as_the_real_server_did(cluster: MockCluster, case: dict[str, Any]) -> None:
    base = PATHS[case["kind"]].format(ns="default")
    seed = case.get("create")
    name = (seed or case["body"])["metadata"]["name"]
    cluster.answer("DELETE", f"{base}/{name}", None)  # the cases that patch share one object's name
    if seed is not None:
        code, _, created = cluster.answer("POST", base, seed)
        assert code == 201, created
        code, warnings, answer = cluster.answer(
            "PATCH", f"{base}/{name}", case["body"], case["params"], case["content_type"]
        )
    else:
        code, warnings, answer = cluster.answer("POST", base, case["body"], case["params"])
    real = case["answer"]
    assert code == real["code"], answer
    assert warnings == real["warnings"]
    if code >= 400:
        assert answer.get("reason") == real["reason"]
        if real["message"] is not None:
            assert answer.get("message") == real["message"]
        else:
            assert str(answer.get("message")).endswith(real["message_endswith"])
        causes = (answer.get("details") or {}).get("causes") or []
        assert [(c.get("reason"), c.get("field")) for c in causes] == [
            (c["reason"], c["field"]) for c in real["causes"]
        ]
    else:
        _, _, stored = cluster.answer("GET", f"{base}/{name}", None)
        assert ("bogusField" in json.dumps(stored)) == real.get("stored_has_unknown", False)
