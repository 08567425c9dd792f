"""The activator's control loop: wake on held requests, feed the gate's capacity, idle scale-down.

Every `poll_seconds` (and at once when a request is held) it reads the workload:
- gone: every held and new request gets 503 (the model was deleted);
- held requests and spec.replicas 0: scale to `wake_replicas` (the model's wake count), unless KEDA
  does the waking (`wake` False: KEDA reads the held requests through kubeinfer_activator_pending);
- capacity = ready replicas x `per_replica` (each replica's --max-concurrent-requests);
- with `idle_scale_down` (the built-in path; KEDA scales down itself): scale to zero after
  `scale_down_delay` seconds with nothing held or in flight, and only when every desired replica is
  ready (a replica still downloading or loading is left to finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from ..k8s import ApiError
from .gate import Gate
from .metrics import ActivatorMetrics
from .scaler import Scaler, WorkloadState

log = logging.getLogger("kubeinfer.activator")


@dataclass(frozen=True)
class ControllerConfig:
    """Raises ValueError on out-of-range values."""

    per_replica: int
    wake_replicas: int
    scale_down_delay: float
    idle_scale_down: bool
    poll_seconds: float = 1.0
    # Whether the activator writes the wake-up itself (the built-in path). Under KEDA it does not:
    # KEDA scales to zero whenever its triggers were inactive for cooldownPeriod, so a wake-up written
    # before Prometheus has scraped the held requests could be undone at once; KEDA's activation
    # trigger on kubeinfer_activator_pending wakes the model instead.
    wake: bool = True

    def __post_init__(self) -> None:
        if self.per_replica < 1 or self.wake_replicas < 1:
            raise ValueError("per_replica and wake_replicas must be at least 1")
        if self.scale_down_delay < 0 or self.poll_seconds <= 0:
            raise ValueError("scale_down_delay must be >= 0 and poll_seconds > 0")


class Controller:
    def __init__(
        self, config: ControllerConfig, gate: Gate, scaler: Scaler, metrics: ActivatorMetrics
    ) -> None:
        self.config = config
        self.gate = gate
        self.scaler = scaler
        self.metrics = metrics
        self.state: WorkloadState | None = None
        self.wake_started: float | None = None

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except ApiError as exc:
                log.warning("activator: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gate.wake_needed.wait(), self.config.poll_seconds)
            self.gate.wake_needed.clear()

    async def step(self) -> None:
        state = await asyncio.to_thread(self.scaler.read)
        self.state = state
        gate = self.gate
        if state is None:
            gate.set_capacity(0)
            gate.close(f"model {self.scaler.name} does not exist (deleted, or not deployed yet)")
            self.wake_started = None
            self._publish(0)
            return
        gate.reopen()
        now = time.monotonic()
        if state.ready >= 1 and self.wake_started is not None:
            self.metrics.observe_wake(now - self.wake_started)
            log.info("activator: %s woke in %.1f s", self.scaler.name, now - self.wake_started)
            self.wake_started = None
        # Replicas being removed may still count as ready for a moment: never send to more than desired.
        gate.set_capacity(min(state.ready, state.desired) * self.config.per_replica)
        if gate.held > 0 and state.desired == 0 and self.config.wake:
            if await asyncio.to_thread(self.scaler.scale, self.config.wake_replicas):
                self.metrics.scaled("up")
                self.wake_started = now
                log.info("activator: waking %s (%d held)", self.scaler.name, gate.held)
        elif (
            self.config.idle_scale_down
            and state.desired > 0
            and state.ready >= state.desired
            and not gate.busy
            and now - gate.last_activity >= self.config.scale_down_delay
        ):
            # Close the gate first: a request arriving during the write is held (and wakes the model
            # again) instead of going to a replica on its way out.
            gate.set_capacity(0)
            if await asyncio.to_thread(self.scaler.scale, 0):
                self.metrics.scaled("down")
                log.info("activator: %s idle, scaled to zero", self.scaler.name)
        self._publish(state.ready)

    def _publish(self, ready: int) -> None:
        waking = self.state is not None and self.state.desired > 0 and ready == 0
        self.metrics.set_state(self.gate.held, self.gate.in_flight, waking, ready)
