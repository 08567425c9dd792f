"""The scheduler's waiting queue under vLLM's two scheduling policies (`--scheduling-policy`).

- `fcfs`: arrival order; a preempted request goes back to the front (it was admitted before everyone
  still waiting).
- `priority`: by (`Request.priority`, arrival time): a lower value first (vLLM's convention), first come
  first served within a level; a preempted request goes back to its place by that key, so ahead of
  later arrivals of its own level and behind every better level.

`victim(running)` names the running request to preempt when blocks run out: the most recently admitted
under fcfs (vLLM's), the worst (priority, arrival) under priority, so a critical request is never
recomputed to make room for a batch one. Plain Python, no torch.

Starvation: `priority` is strict. While requests of better levels keep `--max-num-seqs` seats or the
KV cache full, a worse level waits however long that lasts (no aging), and a running request of a
worse level is preempted (recomputed later) to admit a better one. Bound the better levels' load
(admission limits, the gateway's objectives) where the worst level needs a latency bound.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Literal

from server.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float]:
    """Lower sorts first: priority value, then arrival time."""
    return (req.priority, req.arrival_time)


class RequestQueue:
    """Waiting requests in scheduling order; index access for the scheduler's skip-and-admit loop."""

    def __init__(self, policy: SchedulingPolicy = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._items: list[Request] = []

    def add(self, req: Request) -> None:
        """A new arrival."""
        if self.policy == "fcfs":
            self._items.append(req)
        else:
            bisect.insort_right(self._items, req, key=priority_key)

    def add_preempted(self, req: Request) -> None:
        """A request taken off the running list, to be recomputed."""
        if self.policy == "fcfs":
            self._items.insert(0, req)
        else:
            bisect.insort_left(self._items, req, key=priority_key)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __delitem__(self, index: int) -> None:
        del self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, req: object) -> bool:
        return req in self._items

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out (running must not be empty)."""
        if self.policy == "fcfs":
            return running[-1]
        return max(running, key=priority_key)
