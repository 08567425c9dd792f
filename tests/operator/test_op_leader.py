"""Lease-based leader election (kubeinfer_operator/leader.py) against kmock's Lease API with the API
server's optimistic concurrency (a PUT with a stale resourceVersion gets 409 Conflict): who holds the
Lease, when another candidate may take it, what each write puts in holderIdentity, acquireTime,
renewTime and leaseTransitions, and that a racing update loses."""

from __future__ import annotations

import threading
import time
import urllib.error
from typing import Any

import kubernetes_validate
import pytest
from kubeinfer_operator.k8s import KubeClient
from kubeinfer_operator.leader import (
    LeaderElectionConfig,
    LeaderElector,
    LeaseConflictError,
    parse_duration,
)
from op_cluster import Fault, MockCluster, wait_for
from op_testlib import K8S_VERSIONS

LEASE = "kubeinfer-operator"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(identity: str, **timing: float) -> LeaderElectionConfig:
    return LeaderElectionConfig(lease_name=LEASE, namespace="default", identity=identity, **timing)  # type: ignore[arg-type]


def lease(cluster: MockCluster) -> dict[str, Any]:
    out = cluster.get("Lease", LEASE)
    assert out is not None
    # Every Lease the elector writes is one the API server's schema accepts.
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(out, version, strict=True)
    return out


@pytest.fixture
def kube(cluster: MockCluster) -> Any:
    client = KubeClient.from_environment(request_timeout=5)
    yield client
    client.close()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("15s", 15.0), ("1m30s", 90.0), ("500ms", 0.5), ("2", 2.0), ("0.25", 0.25), ("1h", 3600.0)],
)
def test_durations_parse_like_go(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["fifteen", "15 s", "-1s", "0s", "1d", ""])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ({"lease_duration": 10.0, "renew_deadline": 10.0}, "greater than the renew deadline"),
        ({"renew_deadline": 2.0, "retry_period": 2.0}, r"greater than 1.2 x the retry period"),
        ({"retry_period": 0.0}, "positive"),
    ],
)
def test_timing_that_cannot_work_is_refused(timing: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config("a", **timing)


def test_names_must_be_valid() -> None:
    with pytest.raises(ValueError, match="DNS-1123"):
        LeaderElectionConfig(lease_name="Bad_Name", namespace="default", identity="a")
    with pytest.raises(ValueError, match="identity"):
        LeaderElectionConfig(lease_name=LEASE, namespace="default", identity="")
    assert config("a").lease_duration == 15.0 and config("a").renew_deadline == 10.0
    assert config("a").retry_period == 2.0  # controller-runtime's defaults


def test_first_candidate_creates_the_lease_and_renews_it(cluster: MockCluster, kube: KubeClient) -> None:
    clock = FakeClock()
    a = LeaderElector(kube, config("a"), clock=clock)
    b = LeaderElector(kube, config("b"), clock=clock)
    assert a.try_acquire_or_renew() and a.is_leader
    first = lease(cluster)
    spec = first["spec"]
    assert spec["holderIdentity"] == "a"
    assert spec["leaseDurationSeconds"] == 15
    assert spec["leaseTransitions"] == 0
    assert spec["acquireTime"] == spec["renewTime"]
    assert spec["renewTime"].endswith("Z") and "." in spec["renewTime"]  # MicroTime

    # Another candidate may not take a Lease renewed within its duration.
    assert not b.try_acquire_or_renew() and not b.is_leader
    assert b.observed_holder == "a"
    time.sleep(0.01)  # renewTime has microseconds: a renewal must show
    clock.now += 10
    assert a.try_acquire_or_renew()
    renewed = lease(cluster)
    assert renewed["spec"]["holderIdentity"] == "a"
    assert renewed["spec"]["acquireTime"] == spec["acquireTime"]  # kept while the holder renews
    assert renewed["spec"]["renewTime"] > spec["renewTime"]
    assert renewed["spec"]["leaseTransitions"] == 0
    assert renewed["metadata"]["resourceVersion"] != first["metadata"]["resourceVersion"]
    assert renewed["metadata"]["uid"] == first["metadata"]["uid"]


def test_takeover_only_after_the_lease_duration_on_the_candidates_clock(
    cluster: MockCluster, kube: KubeClient
) -> None:
    clock = FakeClock()
    a = LeaderElector(kube, config("a"), clock=clock)
    b = LeaderElector(kube, config("b"), clock=clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # b first sees a's record now
    clock.now += 14.9
    assert not b.try_acquire_or_renew(), "the record is 14.9 s old on b's clock: still a's"
    clock.now += 0.2
    assert b.try_acquire_or_renew() and b.is_leader
    spec = lease(cluster)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"]
    # The old leader's next attempt sees the new holder and does not lead.
    assert not a.try_acquire_or_renew() and not a.is_leader
    assert lease(cluster)["spec"]["holderIdentity"] == "b"

    # A renewal by b resets the time a must wait (a observes a changed record).
    clock.now += 10
    assert b.try_acquire_or_renew()
    assert not a.try_acquire_or_renew()
    clock.now += 14
    assert not a.try_acquire_or_renew()


def test_a_racing_update_gets_409_conflict(cluster: MockCluster, kube: KubeClient) -> None:
    a = LeaderElector(kube, config("a"))
    assert a.try_acquire_or_renew()
    read = lease(cluster)
    # Two writers replace the Lease from the same read: the API server accepts the first only.
    first = {**read, "spec": {**read["spec"], "holderIdentity": "x"}}
    second = {**read, "spec": {**read["spec"], "holderIdentity": "y"}}
    cluster.replace("Lease", first)
    with pytest.raises(urllib.error.HTTPError) as err:
        cluster.replace("Lease", second)
    assert err.value.code == 409
    assert "the object has been modified" in err.value.read().decode()
    assert lease(cluster)["spec"]["holderIdentity"] == "x"
    # Through the operator's client, a 409 is a LeaseConflictError, and creating an existing Lease too.
    with pytest.raises(LeaseConflictError):
        kube.replace_lease("default", LEASE, second)
    with pytest.raises(LeaseConflictError):
        kube.create_lease("default", {**read, "metadata": {"name": LEASE, "namespace": "default"}})


class RacingStore:
    """Lets a rival write the Lease between this candidate's read and its write."""

    def __init__(self, kube: KubeClient, rival: Any) -> None:
        self.kube = kube
        self.rival = rival

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        out = self.kube.get_lease(namespace, name)
        self.rival()
        return out

    def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.kube.create_lease(namespace, body)

    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.kube.replace_lease(namespace, name, body)


def test_two_candidates_taking_an_expired_lease_never_both_win(
    cluster: MockCluster, kube: KubeClient
) -> None:
    clock = FakeClock()
    old = LeaderElector(kube, config("old"), clock=clock)
    assert old.try_acquire_or_renew()
    c = LeaderElector(kube, config("c"), clock=clock)
    armed: list[bool] = []

    def rival() -> None:
        if armed:
            armed.clear()
            assert c.try_acquire_or_renew()

    b = LeaderElector(RacingStore(kube, rival), config("b"), clock=clock)  # type: ignore[arg-type]
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()  # both see old's record
    clock.now += 16  # old stopped renewing: expired for both
    armed.append(True)  # c takes the Lease between b's read and b's write
    assert not b.try_acquire_or_renew()
    assert c.is_leader and not b.is_leader
    spec = lease(cluster)["spec"]
    assert spec["holderIdentity"] == "c"
    assert spec["leaseTransitions"] == 1, "one takeover, one transition"

    # Two candidates creating a missing Lease at once: the second create gets 409 and does not lead.
    cluster.delete("Lease", LEASE)
    d = LeaderElector(kube, config("d"), clock=clock)
    e = LeaderElector(RacingStore(kube, d.try_acquire_or_renew), config("e"), clock=clock)  # type: ignore[arg-type]
    assert not e.try_acquire_or_renew()
    assert d.is_leader and not e.is_leader and lease(cluster)["spec"]["holderIdentity"] == "d"


def test_release_lets_the_next_candidate_lead_at_once(cluster: MockCluster, kube: KubeClient) -> None:
    clock = FakeClock()
    a = LeaderElector(kube, config("a"), clock=clock)
    b = LeaderElector(kube, config("b"), clock=clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.release() and not a.is_leader
    spec = lease(cluster)["spec"]
    assert not spec.get("holderIdentity") and spec["leaseDurationSeconds"] == 1
    assert b.try_acquire_or_renew(), "a released Lease is free without waiting for its duration"
    spec = lease(cluster)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert not a.release(), "only the holder releases"
    assert lease(cluster)["spec"]["holderIdentity"] == "b"


def test_leadership_is_lost_when_renewals_fail_for_the_renew_deadline(
    cluster: MockCluster, kube: KubeClient
) -> None:
    timing = {"lease_duration": 1.5, "renew_deadline": 1.0, "retry_period": 0.2}
    # a's clock only moves when the test moves it: "no renewal for the renew deadline" is decided on it,
    # not on how fast a loaded machine runs the renewals (a wall-clock bound on the loss failed there).
    clock = FakeClock()
    a = LeaderElector(kube, config("a", **timing), clock=clock)
    assert a.acquire(threading.Event())
    lost = threading.Event()
    a.start_renewing(lost.set)
    first = lease(cluster)["spec"]["renewTime"]
    wait_for(lambda: lease(cluster)["spec"]["renewTime"] != first, timeout=60, what="a renewal")
    assert not lost.is_set() and a.is_leader
    # The API server stops accepting a's writes (a partition, an outage).
    refused = Fault(503, count=10_000, method="PUT", plural="leases")
    cluster.server.faults.append(refused)

    clock.now += 0.5  # half the renew deadline without a renewal: still leading
    # The second refusal after the clock moved: the renewal before it checked the deadline on it.
    seen = refused.fired
    wait_for(lambda: refused.fired >= seen + 2, timeout=60, what="two more refused renewals")
    assert not lost.is_set() and a.is_leader
    clock.now += 0.5  # the renew deadline: given up at the next failed renewal
    assert lost.wait(60), "leadership not given up"
    assert not a.is_leader
    a.stop()
    # A second candidate takes over once the record is a lease duration old.
    cluster.server.faults.clear()
    b = LeaderElector(kube, config("b", **timing))
    stop = threading.Event()
    timer = threading.Timer(60, stop.set)
    timer.start()
    try:
        assert b.acquire(stop)
    finally:
        timer.cancel()
    assert lease(cluster)["spec"]["holderIdentity"] == "b"


class GatedStore:
    """The elector's Lease calls, each made under `gate`: whoever holds it (the test) reads and writes
    the Lease with no renewal landing in between."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self.gate = threading.Lock()

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self.gate:
            return self.kube.get_lease(namespace, name)

    def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.gate:
            return self.kube.create_lease(namespace, body)

    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.gate:
            return self.kube.replace_lease(namespace, name, body)


def test_a_leader_that_sees_another_holder_stops_at_once(cluster: MockCluster, kube: KubeClient) -> None:
    timing = {"lease_duration": 15.0, "renew_deadline": 10.0, "retry_period": 0.2}
    store = GatedStore(kube)
    # a's clock stands still, so its renew deadline never passes: only the intruder can end its lead (a
    # wall-clock bound on the loss failed on a loaded machine).
    a = LeaderElector(store, config("a", **timing), clock=FakeClock())  # type: ignore[arg-type]
    assert a.acquire(threading.Event())
    lost = threading.Event()
    a.start_renewing(lost.set)
    # Someone (an admin, a candidate with a skewed view) writes another holder into the Lease. Under the
    # gate: a renewal between this read and this write would make the write a 409 (stale
    # resourceVersion). A renewal that read the Lease before it gets the 409 instead, and the next one
    # sees the intruder.
    with store.gate:
        current = lease(cluster)
        cluster.replace("Lease", {**current, "spec": {**current["spec"], "holderIdentity": "intruder"}})
    assert lost.wait(60), "leadership not given up"
    assert not a.is_leader
    a.stop()
    assert lease(cluster)["spec"]["holderIdentity"] == "intruder", "never released what is not ours"
