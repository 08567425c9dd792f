"""Admission in front of a model that may be at zero replicas: plain asyncio, no I/O.

A request goes straight through while fewer than `capacity` requests are in flight (capacity = ready
replicas x each replica's --max-concurrent-requests) and nobody is held before it; otherwise it is held
(FIFO) up to `max_held` requests for at most its deadline. So a burst held at zero reaches the first
replica only as fast as that replica admits requests; the rest wait for it or for more replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass


class Refused(Exception):
    """The request is answered 503 with Retry-After (`retry_after` seconds) and this message."""

    def __init__(self, reason: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason  # "held_limit" | "wait_timeout" | "model_gone"
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class GateConfig:
    """Raises ValueError on a bound below one."""

    max_held: int
    max_wait_seconds: float
    retry_after_seconds: int = 5

    def __post_init__(self) -> None:
        if self.max_held < 1 or self.max_wait_seconds <= 0 or self.retry_after_seconds < 1:
            raise ValueError("max_held, max_wait_seconds and retry_after_seconds must be positive")


class Gate:
    def __init__(self, config: GateConfig, model: str) -> None:
        self.config = config
        self.model = model
        self.capacity = 0
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._gone: str | None = None
        self.last_activity = time.monotonic()
        # Set whenever a request is held: the controller wakes the model without waiting for its poll.
        self.wake_needed = asyncio.Event()

    @property
    def held(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        return self.held > 0 or self.in_flight > 0

    async def admit(self) -> None:
        """Returns once the request may be sent on (the caller must then call `release` once);
        raises Refused when the model is gone, too many are held, or the wait runs out."""
        if self._gone is not None:
            raise Refused("model_gone", self._gone, self.config.retry_after_seconds)
        self.last_activity = time.monotonic()
        if not self._waiters and self.in_flight < self.capacity:
            self.in_flight += 1
            return
        if self.held >= self.config.max_held:
            raise Refused(
                "held_limit",
                f"model {self.model} is starting: {self.held} requests are already waiting for it; "
                f"retry in {self.config.retry_after_seconds} s",
                self.config.retry_after_seconds,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.wake_needed.set()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.max_wait_seconds)
        except TimeoutError:
            if waiter.done() and waiter.exception() is None:
                return  # admitted in the same instant: in_flight already counts it
            self._drop(waiter)
            raise Refused(
                "wait_timeout",
                f"model {self.model} is starting and had no ready replica within "
                f"{self.config.max_wait_seconds:g} s; retry in {self.config.retry_after_seconds} s",
                self.config.retry_after_seconds,
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # the client left after being admitted
            else:
                self._drop(waiter)
            raise
        # A Refused set by `close` is raised by the await above.

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if not waiter.done():
            waiter.cancel()

    def release(self) -> None:
        assert self.in_flight > 0, "release without admit"
        self.in_flight -= 1
        self.last_activity = time.monotonic()
        self._dispatch()

    def set_capacity(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._waiters and self.in_flight < self.capacity:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self.in_flight += 1
            waiter.set_result(None)

    def close(self, message: str) -> None:
        """The model is gone: every held request and every new one gets 503 with `message`."""
        self._gone = message
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(Refused("model_gone", message, self.config.retry_after_seconds))

    def reopen(self) -> None:
        self._gone = None
