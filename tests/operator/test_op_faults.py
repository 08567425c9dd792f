"""Operator faults (issue 7): kmock injects 409 conflicts, 500s and dropped watch streams, and the
operator is restarted in the middle of a reconcile. The end state must have exactly one of each
child, with correct owner references, and a status that says what happened."""

from __future__ import annotations

from typing import Any

from op_cluster import Fault, MockCluster, WatchDrop, condition, run_operator, wait_for
from op_testlib import inference_model

NAME = "llm"
CHILDREN = ("Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget")
SPEC = {"model": {"uri": "hf://org/model"}, "scaling": {"replicas": 2}}


def is_apply(request: Any) -> bool:
    return "apply-patch" in (request.headers.get("Content-Type") or "")


def assert_converged(cluster: MockCluster) -> dict[str, Any]:
    """Exactly one of each child, each controlled by the model, and a healthy status."""
    im = cluster.get("InferenceModel", NAME)
    assert im is not None
    for kind in CHILDREN:
        objs = cluster.live(kind)
        assert len(objs) == 1, (kind, [o["metadata"]["name"] for o in objs])
        refs = objs[0]["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["name"], r["uid"], r["controller"], r["blockOwnerDeletion"]) for r in refs] == [
            ("InferenceModel", NAME, im["metadata"]["uid"], True, True)
        ], kind
    return im


def degraded_history(cluster: MockCluster) -> list[dict[str, Any]]:
    """Every Degraded condition the model's status has shown, oldest first."""
    out: list[dict[str, Any]] = []
    for version in cluster.history("InferenceModel", NAME):
        cond = condition(version, "Degraded")
        if cond is not None and (not out or out[-1] != cond):
            out.append(cond)
    return out


def test_server_errors_are_retried_and_reported(cluster: MockCluster) -> None:
    cluster.server.faults.append(
        Fault(status=500, count=3, method="PATCH", plural="deployments", predicate=is_apply)
    )
    with run_operator():
        cluster.create("InferenceModel", inference_model(SPEC, name=NAME))
        wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment after retries")
        recovered = wait_for(
            lambda: (
                (c := condition(cluster.get("InferenceModel", NAME), "Degraded"))
                and c["reason"] == "Recovered"
                and c
            ),
            what="Degraded=False/Recovered",
        )
    assert cluster.server.faults[0].fired == 3
    assert recovered["status"] == "False"
    assert "500" in recovered["message"] and "Deployment default/llm" in recovered["message"]
    # While the API failed, the status said so (and did not pretend to be fine).
    history = degraded_history(cluster)
    failing = [c for c in history if c["status"] == "True"]
    assert failing and failing[0]["reason"] == "ApplyFailed" and "500" in failing[0]["message"]
    assert any(
        v.get("status", {}).get("phase") == "Degraded" for v in cluster.history("InferenceModel", NAME)
    )
    assert_converged(cluster)


def test_conflicts_are_retried(cluster: MockCluster) -> None:
    faults = [
        Fault(status=409, count=2, method="PATCH", plural="services", predicate=is_apply),
        Fault(status=409, count=2, method="PATCH", plural="deployments", predicate=is_apply),
        Fault(status=409, count=2, method="PATCH", plural="inferencemodels", subresource="status"),
    ]
    cluster.server.faults.extend(faults)
    with run_operator():
        cluster.create("InferenceModel", inference_model(SPEC, name=NAME))
        wait_for(
            lambda: (
                all(cluster.get(kind, NAME) for kind in CHILDREN)
                and (cluster.get("InferenceModel", NAME) or {}).get("status", {}).get("phase") == "Pending"
            ),
            what="children and status",
        )
        assert [f.fired for f in faults] == [2, 2, 2]
        # A later spec change still goes through after the conflicts.
        cluster.patch("InferenceModel", NAME, {"spec": {"engine": {"maxNumSeqs": 8}}})
        wait_for(
            lambda: (
                "--max-num-seqs"
                in (cluster.get("Deployment", NAME) or {})["spec"]["template"]["spec"]["containers"][0][
                    "args"
                ]
            ),
            what="rollout after conflicts",
        )
        wait_for(
            lambda: (
                (cluster.get("InferenceModel", NAME) or {}).get("status", {}).get("observedGeneration") == 2
            ),
            what="status gen 2",
        )
    im = assert_converged(cluster)
    reasons = {c["reason"] for c in degraded_history(cluster)}
    assert "ApplyFailed" in reasons  # the conflicts were reported while they lasted
    assert condition(im, "Degraded")["status"] == "False"  # type: ignore[index]


def test_dropped_watches_do_not_lose_changes(cluster: MockCluster) -> None:
    cluster.server.watch_drops.extend(
        [
            WatchDrop(count=6, after=0.3, plural="inferencemodels"),
            WatchDrop(count=6, after=0.3, plural="deployments"),
        ]
    )
    with run_operator():
        cluster.create("InferenceModel", inference_model(SPEC, name=NAME))
        wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment")
        cluster.patch("InferenceModel", NAME, {"spec": {"engine": {"maxModelLen": 2048}}})
        wait_for(
            lambda: (
                "--max-total-tokens"
                in (cluster.get("Deployment", NAME) or {})["spec"]["template"]["spec"]["containers"][0][
                    "args"
                ]
            ),
            what="update seen across dropped watches",
        )
        cluster.delete("Deployment", NAME)
        wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment recreated across dropped watches")
        wait_for(lambda: all(d.fired == d.count for d in cluster.server.watch_drops), what="all drops used")
        wait_for(
            lambda: (
                (cluster.get("InferenceModel", NAME) or {}).get("status", {}).get("observedGeneration") == 2
            ),
            what="status",
        )
    assert cluster.count_requests("GET", "inferencemodels") > 6  # kopf re-listed and re-watched
    assert_converged(cluster)


def test_restart_in_the_middle_of_a_reconcile(cluster: MockCluster) -> None:
    # The Deployment cannot be applied: the first operator gets half-way (Service, PDB) and is stopped.
    outage = Fault(status=500, count=10_000, method="PATCH", plural="deployments", predicate=is_apply)
    cluster.server.faults.append(outage)
    with run_operator():
        cluster.create("InferenceModel", inference_model(SPEC, name=NAME))
        wait_for(
            lambda: cluster.get("Service", NAME) and cluster.get("PodDisruptionBudget", NAME),
            what="partial apply",
        )
        degraded = wait_for(
            lambda: condition(cluster.get("InferenceModel", NAME), "Degraded"), what="Degraded"
        )
        assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
        assert cluster.get("Deployment", NAME) is None
    # While no operator runs, the API recovers and the user changes the spec.
    outage.count = outage.fired
    cluster.patch("InferenceModel", NAME, {"spec": {"engine": {"maxModelLen": 1024}}})

    with run_operator():
        dep = wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment after restart")
        wait_for(
            lambda: (
                "--max-total-tokens"
                in (cluster.get("Deployment", NAME) or {})["spec"]["template"]["spec"]["containers"][0][
                    "args"
                ]
            ),
            what="spec changed during downtime applied",
        )
        final = wait_for(
            lambda: (
                (c := condition(cluster.get("InferenceModel", NAME), "Degraded"))
                and c["status"] == "False"
                and c
            ),
            what="Degraded cleared",
        )
    assert dep is not None
    assert final["reason"] == "Recovered" and "500" in final["message"]
    im = assert_converged(cluster)
    assert im["status"]["observedGeneration"] == im["metadata"]["generation"] == 2
    assert im["status"]["phase"] == "Pending"


def test_read_errors_injected_with_a_kmock_reaction(cluster: MockCluster) -> None:
    # kmock's own DSL: a reaction answers matching requests with 500 ahead of the emulator's fallback.
    # Reads only: the emulator records writes before reactions run, so write faults use Fault above.
    hit: set[int] = set()

    def first_three_pdb_reads(request: Any) -> bool:
        if str(getattr(request.method, "value", request.method)) != "GET" or request.resource is None:
            return False
        if request.resource.plural != "poddisruptionbudgets" or request.name is None:
            return False
        if request.id in hit or len(hit) < 3:  # kmock may evaluate a criterion more than once
            hit.add(request.id)
            return True
        return False

    cluster.server[first_three_pdb_reads] << 500
    with run_operator():
        # One replica: no PDB is wanted, so the reconcile checks that none is left (a GET).
        cluster.create("InferenceModel", inference_model({"model": {"uri": "hf://org/model"}}, name=NAME))
        recovered = wait_for(
            lambda: (
                (c := condition(cluster.get("InferenceModel", NAME), "Degraded"))
                and c["reason"] == "Recovered"
                and c
            ),
            what="Recovered after read errors",
        )
    assert len(hit) == 3
    assert "reading PodDisruptionBudget default/llm" in recovered["message"]
    assert len(cluster.live("Deployment")) == len(cluster.live("Service")) == 1
    assert cluster.live("PodDisruptionBudget") == []
