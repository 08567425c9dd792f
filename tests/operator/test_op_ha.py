"""High availability: several operator processes (`python -m kubeinfer_operator run --leader-elect`,
the chart's command) against one kmock API. Only the Lease holder reconciles; when it stops (cleanly,
killed, or cut off from the API) another takes over within the lease time, and every model ends with
exactly its children: none duplicated, none orphaned.

Each process gets its own bearer token, so every request the API server saw is attributed to the
process that made it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubeinfer_operator.render import Capabilities, render_all
from kubeinfer_operator.spec import InferenceModel
from op_cluster import Fault, MockCluster, wait_for
from op_testlib import REPO, inference_model
from serving import free_port

pytestmark = pytest.mark.slow

LEASE = "kubeinfer-operator"
# Shorter than controller-runtime's 15/10/2 s, long enough for a machine shared by many processes: on
# a loaded one each call to the mock API server took 0.5 s, and a 4 s renew deadline (renewals of a GET
# and a PUT every 1 s) left a leader little margin before it gave up a Lease nobody else wanted.
LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 12.0, 8.0, 2.0
CHILD_KINDS = (
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ServiceMonitor",
    "NetworkPolicy",
    "ServiceAccount",  # each model's own (issue 45 item 7)
)
WRITES = {"POST", "PUT", "PATCH", "DELETE"}


@dataclass(frozen=True)
class Write:
    index: int  # position in the API server's request log
    method: str
    plural: str
    name: str | None


class Operator:
    """One operator process, identified by its token and its Lease identity."""

    def __init__(self, cluster: MockCluster, tmp: Path, identity: str) -> None:
        self.identity = identity
        self.token = f"token-{identity}"
        self.port = free_port()
        kubeconfig = cluster.write_kubeconfig(tmp / f"kubeconfig-{identity}")
        kubeconfig.write_text(kubeconfig.read_text().replace("test-token", self.token))
        self.log_path = tmp / f"operator-{identity}.log"
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": f"{REPO}:{REPO / 'operator'}",
            "POD_NAMESPACE": "default",
            # Watch streams end (and the models are re-listed and re-checked) this often.
            "KUBEINFER_RESYNC_SECONDS": "20",
            "KUBEINFER_RETRY_BASE_SECONDS": "0.2",
            "KUBEINFER_RETRY_MAX_SECONDS": "1",
            "KUBEINFER_DISCOVERY_TTL_SECONDS": "1",
            "KUBEINFER_REQUEST_TIMEOUT_SECONDS": "5",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        args = [
            sys.executable,
            "-m",
            "kubeinfer_operator",
            "run",
            "--all-namespaces",
            f"--liveness=http://127.0.0.1:{self.port}/healthz",
            "--leader-elect",
            f"--leader-elect-identity={identity}",
            f"--leader-elect-lease-duration={LEASE_DURATION}s",
            f"--leader-elect-renew-deadline={RENEW_DEADLINE}s",
            f"--leader-elect-retry-period={RETRY_PERIOD * 1000:.0f}ms",
            "--verbose",
        ]
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def writes(self, cluster: MockCluster, since: int = 0) -> list[Write]:
        """Every write this process made, from request number `since` on, in the API server's order."""
        out = []
        for index, r in enumerate(list(cluster.server)):
            method = str(getattr(r.method, "value", r.method)).upper()
            if (
                index >= since
                and method in WRITES
                and r.headers.get("Authorization") == f"Bearer {self.token}"
            ):
                out.append(Write(index, method, r.resource.plural if r.resource else "", r.name))
        return out

    def lease_writes(self, cluster: MockCluster) -> list[int]:
        return [w.index for w in self.writes(cluster) if w.plural == "leases"]

    def lease_reads(self, cluster: MockCluster) -> list[int]:
        """Where this process's GETs of the Lease are in the API server's request log."""
        return [
            index
            for index, r in enumerate(list(cluster.server))
            if str(getattr(r.method, "value", r.method)).upper() == "GET"
            and r.resource is not None
            and r.resource.plural == "leases"
            and r.headers.get("Authorization") == f"Bearer {self.token}"
        ]

    def child_writes(self, cluster: MockCluster, since: int = 0) -> list[int]:
        return [w.index for w in self.writes(cluster, since) if w.plural not in ("leases", "events")]

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        # The chart's pods get Kubernetes' default 30 s grace period, but a reconcile under way runs to its
        # end before the Lease is released: on a loaded machine, where each of its ~20 reads of the mock
        # API server took 0.5 s, c exited 46 s after SIGTERM.
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.identity} did not stop:\n{self.output()[-4000:]}") from None
        finally:
            self.log.close()


@pytest.fixture
def operators(cluster: MockCluster, tmp_path: Path) -> Iterator[Any]:
    started: list[Operator] = []

    def start(identity: str) -> Operator:
        op = Operator(cluster, tmp_path, identity)
        started.append(op)
        return op

    yield start
    for op in started:
        if op.proc.poll() is None:
            op.proc.kill()
            op.proc.wait(10)


def stored(cluster: MockCluster, kind: str, name: str) -> dict[str, Any] | None:
    """An object straight from the emulator's store (the tests poll; HTTP polling would load the API
    the operators use)."""
    return next((o for o in cluster.live(kind) if o["metadata"]["name"] == name), None)


def holder(cluster: MockCluster) -> str | None:
    lease = stored(cluster, "Lease", LEASE) or {}
    return (lease.get("spec") or {}).get("holderIdentity") or None


def transitions(cluster: MockCluster) -> int:
    return int(((stored(cluster, "Lease", LEASE) or {}).get("spec") or {}).get("leaseTransitions") or 0)


def assert_children_exact(cluster: MockCluster) -> None:
    """Every live model has exactly the children render_all wants (one of each), and no child is
    orphaned (its owner must be a live model)."""
    models = {m["metadata"]["uid"]: m for m in cluster.live("InferenceModel")}
    for kind in CHILD_KINDS:
        for child in cluster.live(kind):
            owners = [r["uid"] for r in child["metadata"].get("ownerReferences") or []]
            assert owners and all(uid in models for uid in owners), f"orphaned {kind} {child['metadata']}"
    for uid, body in models.items():
        im = InferenceModel.from_manifest(body)
        wanted = sorted((o["kind"], o["metadata"]["name"]) for o in render_all(im, Capabilities()).objects)
        have = sorted(
            (kind, c["metadata"]["name"])
            for kind in CHILD_KINDS
            for c in cluster.live(kind)
            if any(r["uid"] == uid for r in c["metadata"].get("ownerReferences") or [])
        )
        assert have == wanted, f"{im.name}: {have} != {wanted}"


def children_ready(cluster: MockCluster, name: str) -> bool:
    body = stored(cluster, "InferenceModel", name)
    if body is None:
        return False
    im = InferenceModel.from_manifest(body)
    return all(
        stored(cluster, o["kind"], o["metadata"]["name"]) is not None
        for o in render_all(im, Capabilities()).objects
    )


def model(name: str, scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"uri": "hf://org/model"}}
    if scaling:
        spec["scaling"] = scaling
    return inference_model(spec, name=name)


def test_only_the_leader_reconciles_and_the_next_one_takes_over(cluster: MockCluster, operators: Any) -> None:
    a = operators("a")
    wait_for(lambda: holder(cluster) == "a", timeout=180, what="a leads")
    b = operators("b")
    wait_for(b.healthy, timeout=180, what="b's liveness endpoint while it waits")
    cluster.create("InferenceModel", model("m1", {"replicas": 2, "maxReplicas": 2}))
    cluster.create("InferenceModel", model("m2", {"autoscaler": "HPA", "minReplicas": 1, "maxReplicas": 3}))
    wait_for(
        lambda: children_ready(cluster, "m1") and children_ready(cluster, "m2"), timeout=180, what="children"
    )
    assert holder(cluster) == "a" and transitions(cluster) == 0
    assert a.child_writes(cluster), "the leader applied the children"
    assert b.writes(cluster) == [], "the standby wrote nothing, not even the Lease"
    assert "waiting to lead" in b.output() and "leading as" not in b.output()

    # A clean stop (a rolling update): a releases the Lease after kopf stopped; b leads at once.
    assert a.stop(signal.SIGTERM) == 0, a.output()[-3000:]
    wait_for(lambda: holder(cluster) == "b", timeout=180, what="b leads after a's release")
    # At once, not at the Lease's expiry: b took the released Lease at the first read that could have
    # seen the release (one that raced the release write may come before it). Counted in the API
    # server's log, not in seconds: a wall-clock bound failed on a loaded machine, while a b that waited
    # for the expiry reads the Lease every retry period until then.
    released, acquired = a.lease_writes(cluster)[-1], b.lease_writes(cluster)[0]
    assert len([i for i in b.lease_reads(cluster) if released < i < acquired]) <= 1
    assert transitions(cluster) == 1
    wait_for(b.healthy, timeout=180, what="kopf's liveness endpoint in b, on the standby's port")
    # b reconciles: a spec change rolls out, a new model gets its children, nothing is duplicated.
    cluster.patch("InferenceModel", "m1", {"spec": {"engine": {"maxModelLen": 4096}}})
    cluster.create("InferenceModel", model("m3"))
    wait_for(
        lambda: (
            "--max-total-tokens"
            in (stored(cluster, "Deployment", "m1") or {})["spec"]["template"]["spec"]["containers"][0][
                "args"
            ]
        ),
        timeout=180,
        what="m1 rolled out by b",
    )
    wait_for(lambda: children_ready(cluster, "m3"), timeout=180, what="m3's children by b")
    # Never two writers: a wrote its last child before it released the Lease (its last Lease write),
    # b its first after it acquired the Lease (its first write of any kind).
    released = a.lease_writes(cluster)[-1]
    acquired = b.lease_writes(cluster)[0]
    assert max(a.child_writes(cluster)) < released < acquired < min(b.child_writes(cluster))
    assert b.writes(cluster)[0].plural == "leases"
    assert_children_exact(cluster)

    # A crash: c waits; b is killed without releasing; c leads once the Lease expires on its clock.
    c = operators("c")
    wait_for(c.healthy, timeout=180, what="c's liveness endpoint while it waits")
    wait_for(lambda: "waiting to lead" in c.output(), timeout=180, what="c waiting")
    last_renew = (stored(cluster, "Lease", LEASE) or {})["spec"]["renewTime"]
    wait_for(
        lambda: (stored(cluster, "Lease", LEASE) or {})["spec"]["renewTime"] != last_renew,
        timeout=180,
        what="b renewing",
    )
    renewed = time.monotonic()  # b's last renewal happened at or (if b renewed again) after this
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: holder(cluster) == "c", timeout=LEASE_DURATION + 60, what="c leads after b died")
    taken = time.monotonic()
    # Not before the Lease expired on c's clock (a lease duration after b's last renewal: a machine's load
    # only makes this later) ...
    assert taken - renewed >= LEASE_DURATION - 0.5, taken - renewed
    assert transitions(cluster) == 2
    c_acquired = c.lease_writes(cluster)[0]
    # ... and at c's first attempt after it: c waits at least a retry period between reads, so from its
    # first read of b's last record to the one it took the Lease on, at most a lease duration's worth of
    # reads (a wall-clock bound after the kill failed on a loaded machine; a load only means fewer reads).
    b_last = max(w.index for w in b.writes(cluster))
    waited = [i for i in c.lease_reads(cluster) if b_last < i < c_acquired]
    assert len(waited) <= LEASE_DURATION / RETRY_PERIOD + 2, len(waited)
    assert c.writes(cluster)[0].plural == "leases"
    assert max(w.index for w in b.writes(cluster)) < c_acquired
    cluster.delete("InferenceModel", "m2")
    cluster.patch("InferenceModel", "m3", {"spec": {"scaling": {"replicas": 2, "maxReplicas": 2}}})
    wait_for(lambda: stored(cluster, "PodDisruptionBudget", "m3"), timeout=180, what="m3's PDB by c")
    wait_for(lambda: stored(cluster, "Deployment", "m2") is None, timeout=180, what="m2 collected")
    assert min(c.child_writes(cluster)) > c_acquired
    assert_children_exact(cluster)
    assert sorted(m["metadata"]["name"] for m in cluster.live("InferenceModel")) == ["m1", "m3"]
    assert len(cluster.live("Deployment")) == 2 and len(cluster.live("Service")) == 2
    assert c.stop(signal.SIGTERM) == 0, c.output()[-3000:]


def test_a_leader_that_cannot_renew_exits_and_the_standby_takes_over(
    cluster: MockCluster, operators: Any
) -> None:
    a = operators("a")
    wait_for(lambda: holder(cluster) == "a", timeout=180, what="a leads")
    b = operators("b")
    wait_for(b.healthy, timeout=180, what="b waiting")
    cluster.create("InferenceModel", model("m1"))
    wait_for(lambda: children_ready(cluster, "m1"), timeout=180, what="children")
    # The API server refuses a's Lease updates from now on (a partition between a and the API).
    refused = Fault(
        503,
        count=10_000,
        method="PUT",
        plural="leases",
        predicate=lambda r: r.headers.get("Authorization") == f"Bearer {a.token}",
    )
    cluster.server.faults.append(refused)
    assert a.proc.wait(RENEW_DEADLINE + 60) == 1, a.output()[-3000:]
    # At the renew deadline, not later: a renews once a retry period, so it gave up after at most a renew
    # deadline's worth of refused renewals, plus the one the cut may split and the release on exit
    # (counted, not timed: a wall-clock bound failed on a loaded machine, which only means fewer tries).
    assert refused.fired <= RENEW_DEADLINE / RETRY_PERIOD + 2, refused.fired
    assert "leader election lost" in a.output()
    wait_for(lambda: holder(cluster) == "b", timeout=LEASE_DURATION + 60, what="b leads")
    assert transitions(cluster) == 1
    cluster.create("InferenceModel", model("m2"))
    wait_for(lambda: children_ready(cluster, "m2"), timeout=180, what="m2's children by b")
    acquired = b.lease_writes(cluster)[0]
    assert max(a.child_writes(cluster)) < acquired < min(b.child_writes(cluster))
    assert_children_exact(cluster)
    assert b.stop(signal.SIGTERM) == 0, b.output()[-3000:]
