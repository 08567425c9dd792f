"""Lease-based leader election on a coordination.k8s.io/v1 Lease, as client-go's `leaderelection`
package does it (the mechanism controller-runtime operators and kube-controller-manager use).

Several operator replicas run; one holds the Lease and reconciles, the others wait. Rules (client-go's
`tryAcquireOrRenew`):
- A missing Lease is created with `holderIdentity` = us, `leaseTransitions` 0.
- A Lease held by someone else is taken only once its record has not changed for
  `leaseDurationSeconds` as measured on *our* clock since we first saw that record (no clock skew
  between pods matters; renewTime is informational). A released Lease (empty holder) is free at once.
- Taking it over increments `leaseTransitions` and sets `acquireTime`; renewing keeps both.
- Every write is a replace (PUT) carrying the resourceVersion that was read: of two racing candidates,
  the API server accepts one and answers the other 409 Conflict, so there is never more than one holder.
- The holder renews every `retry_period`; if no renewal succeeds for `renew_deadline`, leadership is
  lost (`on_lost` runs: the operator exits at once so that the pod restarts as a candidate). Since
  renew_deadline < lease_duration, the old leader has stopped before any other candidate may take over.

Defaults are controller-runtime's: lease duration 15 s, renew deadline 10 s, retry period 2 s.
The Lease is read and written only through `LeaseStore` (implemented by k8s.KubeClient).
"""

from __future__ import annotations

import datetime
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

# client-go's JitterFactor: candidates wait retry_period * (1 + rand * 1.2) between attempts.
JITTER_FACTOR = 1.2
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class LeaseConflictError(Exception):
    """The Lease changed between our read and our write (HTTP 409), or it was created meanwhile."""


class LeaseStore(Protocol):
    """The three Lease calls leader election makes. Each raises LeaseConflictError on HTTP 409 and
    another exception on any other failure."""

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any]: ...

    def replace_lease(self, namespace: str, name: str, lease: dict[str, Any]) -> dict[str, Any]: ...


def parse_duration(text: str) -> float:
    """Seconds from a Go duration (`15s`, `1m30s`, `500ms`) or a plain number of seconds.
    Raises ValueError for anything else, or for a duration that is not positive."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        if not _DURATION.match(value):
            raise ValueError(f"{text!r} is not a duration like 15s, 1m30s or 500ms") from None
        seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return seconds


@dataclass(frozen=True)
class LeaderElectionConfig:
    """Which Lease, who we are, and the timing (seconds). Raises ValueError when the timing cannot
    work: lease_duration > renew_deadline > JITTER_FACTOR * retry_period (client-go's checks)."""

    lease_name: str
    namespace: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    # Give the Lease up on a clean shutdown (a rolling update), so the next leader starts at once
    # instead of after lease_duration. Only after the operator has stopped reconciling.
    release_on_cancel: bool = True

    def __post_init__(self) -> None:
        for field, value in (("lease name", self.lease_name), ("namespace", self.namespace)):
            if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
                raise ValueError(f"leader election {field} {value!r} is not a DNS-1123 subdomain")
        if not self.identity:
            raise ValueError("leader election identity must not be empty")
        if self.retry_period <= 0:
            raise ValueError("leader election retry period must be positive")
        if not self.lease_duration > self.renew_deadline:
            raise ValueError(
                f"lease duration ({self.lease_duration}s) must be greater than the renew deadline "
                f"({self.renew_deadline}s)"
            )
        if not self.renew_deadline > JITTER_FACTOR * self.retry_period:
            raise ValueError(
                f"renew deadline ({self.renew_deadline}s) must be greater than {JITTER_FACTOR} x the "
                f"retry period ({self.retry_period}s)"
            )


def _micro_time(now: datetime.datetime) -> str:
    """metav1.MicroTime as the API server writes it (RFC 3339, microseconds, UTC)."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


class LeaderElector:
    """One candidate. `acquire` blocks until it leads; `start_renewing` keeps the Lease in a thread.

    `clock` (monotonic seconds) and `wall` (UTC now) are injectable for tests."""

    def __init__(
        self,
        store: LeaseStore,
        config: LeaderElectionConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        self.store = store
        self.config = config
        self._clock = clock
        self._wall = wall
        # The last Lease spec we saw and when (our clock) it last changed: client-go's observedRecord.
        self._observed: dict[str, Any] | None = None
        self._observed_at = 0.0
        self._observed_rv: str | None = None
        self._leading = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self._leading

    @property
    def observed_holder(self) -> str | None:
        return (self._observed or {}).get("holderIdentity") or None

    def _lease_body(self, spec: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.config.lease_name, "namespace": self.config.namespace}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_acquire_or_renew(self) -> bool:
        """One attempt to take or keep the Lease. True if we hold it afterwards; never raises for
        API failures or conflicts (they mean: not now)."""
        cfg = self.config
        now = self._wall()
        try:
            lease = self.store.get_lease(cfg.namespace, cfg.lease_name)
            if lease is None:
                spec = {
                    "holderIdentity": cfg.identity,
                    "leaseDurationSeconds": max(1, round(cfg.lease_duration)),
                    "acquireTime": _micro_time(now),
                    "renewTime": _micro_time(now),
                    "leaseTransitions": 0,
                }
                created = self.store.create_lease(cfg.namespace, self._lease_body(spec, None))
                self._observe(created)
                self._leading = True
                return True

            old = dict(lease.get("spec") or {})
            self._observe(lease)
            holder = old.get("holderIdentity") or ""
            ours = holder == cfg.identity
            duration = float(old.get("leaseDurationSeconds") or cfg.lease_duration)
            if holder and not ours and self._clock() < self._observed_at + duration:
                self._leading = False
                return False  # held by another candidate that renewed within its lease duration

            spec = {
                "holderIdentity": cfg.identity,
                "leaseDurationSeconds": max(1, round(cfg.lease_duration)),
                "acquireTime": old.get("acquireTime") if ours else _micro_time(now),
                "renewTime": _micro_time(now),
                "leaseTransitions": int(old.get("leaseTransitions") or 0) + (0 if ours else 1),
            }
            if ours and not spec["acquireTime"]:
                spec["acquireTime"] = _micro_time(now)
            rv = (lease.get("metadata") or {}).get("resourceVersion")
            updated = self.store.replace_lease(cfg.namespace, cfg.lease_name, self._lease_body(spec, rv))
        except LeaseConflictError:
            log.debug("lease %s/%s changed under us; not leading now", cfg.namespace, cfg.lease_name)
            return False
        except Exception as exc:  # API unreachable, throttled, forbidden: not now, try again later
            # A failed renewal does not end leadership by itself: the renew deadline does.
            log.warning("lease %s/%s: %s", cfg.namespace, cfg.lease_name, exc)
            return False
        if not ours:
            log.info(
                "acquired lease %s/%s (previous holder %r)", cfg.namespace, cfg.lease_name, holder or None
            )
        self._observe(updated)
        self._leading = True
        return True

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = dict(lease.get("spec") or {})
        rv = (lease.get("metadata") or {}).get("resourceVersion")
        if spec != self._observed or rv != self._observed_rv:
            self._observed = spec
            self._observed_rv = rv
            self._observed_at = self._clock()

    def acquire(self, stop: threading.Event) -> bool:
        """Block until we lead (True) or `stop` is set (False), trying every retry period (jittered,
        so that candidates started together do not retry in lockstep)."""
        log.info(
            "waiting to lead: lease %s/%s as %s",
            self.config.namespace,
            self.config.lease_name,
            self.config.identity,
        )
        while not stop.is_set():
            if self.try_acquire_or_renew():
                return True
            stop.wait(self.config.retry_period * (1 + random.random() * JITTER_FACTOR))
        return False

    def renew_until_lost(self) -> bool:
        """Renew every retry period until stopped (returns False), or until no renewal succeeded for
        renew_deadline or another candidate is seen holding the Lease (returns True: leadership lost)."""
        cfg = self.config
        last_renewed = self._clock()
        while not self._stop.wait(cfg.retry_period):
            if self.try_acquire_or_renew():
                last_renewed = self._clock()
            elif self.observed_holder not in (None, cfg.identity):
                return True  # another candidate holds the Lease: we are not leading, whatever the deadline
            elif self._clock() - last_renewed >= cfg.renew_deadline:
                self._leading = False
                return True
        return False

    def start_renewing(self, on_lost: Callable[[], None]) -> None:
        """Keep the Lease in a daemon thread; `on_lost` runs in that thread if leadership is lost."""

        def loop() -> None:
            if self.renew_until_lost():
                log.error(
                    "leader election lost: lease %s/%s not renewed within %ss",
                    self.config.namespace,
                    self.config.lease_name,
                    self.config.renew_deadline,
                )
                on_lost()

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="kubeinfer-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; release the Lease if configured (call only after reconciling has stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.renew_deadline + 5)
        if self._leading and self.config.release_on_cancel:
            self.release()

    def release(self) -> bool:
        """Give the Lease up if we hold it: empty holder, leaseDurationSeconds 1 (client-go's release),
        so the next candidate takes it at its next attempt. False if it is not ours or the write failed."""
        cfg = self.config
        try:
            lease = self.store.get_lease(cfg.namespace, cfg.lease_name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
                return False
            now = _micro_time(self._wall())
            spec = {
                "leaseDurationSeconds": 1,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": int((lease.get("spec") or {}).get("leaseTransitions") or 0),
            }
            rv = (lease.get("metadata") or {}).get("resourceVersion")
            self.store.replace_lease(cfg.namespace, cfg.lease_name, self._lease_body(spec, rv))
        except Exception as exc:
            log.warning("lease %s/%s not released: %s", cfg.namespace, cfg.lease_name, exc)
            return False
        self._leading = False
        log.info("released lease %s/%s", cfg.namespace, cfg.lease_name)
        return True
