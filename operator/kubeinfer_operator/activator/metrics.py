"""The activator's Prometheus metrics; the only activator module importing prometheus_client.

Each Activator owns its registry (tests run several in one process). `kubeinfer_activator_pending`
(held + in flight, plus one while the model wakes) is what KEDA's activation trigger reads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Wake latency spans a cached small model (seconds) to a large download (many minutes).
WAKE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


class ActivatorMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._held = Gauge(
            "kubeinfer_activator_held_requests",
            "Requests held waiting for a ready replica",
            labels,
            registry=self.registry,
        ).labels(model)
        self._in_flight = Gauge(
            "kubeinfer_activator_in_flight_requests",
            "Requests sent on to the model and not yet answered",
            labels,
            registry=self.registry,
        ).labels(model)
        self._pending = Gauge(
            "kubeinfer_activator_pending",
            "Held + in-flight requests, plus 1 while the model wakes (KEDA's activation metric)",
            labels,
            registry=self.registry,
        ).labels(model)
        self._replicas = Gauge(
            "kubeinfer_activator_ready_replicas", "Ready replicas last seen", labels, registry=self.registry
        ).labels(model)
        self._wake = Histogram(
            "kubeinfer_activator_wake_seconds",
            "From the first held request at zero replicas to the first ready replica",
            labels,
            buckets=WAKE_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self._refused = Counter(
            "kubeinfer_activator_refused_requests",
            "Requests answered 503 by the activator, by reason (held_limit, wait_timeout, model_gone)",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._scale_events = Counter(
            "kubeinfer_activator_scale_events",
            "Scale subresource writes, by direction (up, down)",
            ["model_name", "direction"],
            registry=self.registry,
        )
        self.model = model

    def set_state(self, held: int, in_flight: int, waking: bool, ready: int) -> None:
        self._held.set(held)
        self._in_flight.set(in_flight)
        self._pending.set(held + in_flight + (1 if waking else 0))
        self._replicas.set(ready)

    def observe_wake(self, seconds: float) -> None:
        self._wake.observe(seconds)

    def refused(self, reason: str) -> None:
        self._refused.labels(self.model, reason).inc()

    def scaled(self, direction: str) -> None:
        self._scale_events.labels(self.model, direction).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
