"""The activator's gate (plain asyncio): FIFO holding within capacity, the bounds, cancellation and a
deleted model, without any I/O."""

from __future__ import annotations

import asyncio

import pytest
from kubeinfer_operator.activator.gate import Gate, GateConfig, Refused


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_held_requests_go_in_arrival_order_as_capacity_allows() -> None:
    async def main() -> None:
        gate = Gate(GateConfig(max_held=10, max_wait_seconds=30), "m")
        order: list[int] = []

        async def request(i: int) -> None:
            await gate.admit()
            order.append(i)

        tasks = [asyncio.create_task(request(i)) for i in range(3)]
        await _settle()
        assert (gate.held, gate.in_flight, order) == (3, 0, [])
        assert gate.wake_needed.is_set()
        gate.set_capacity(1)
        await _settle()
        assert (gate.held, gate.in_flight, order) == (2, 1, [0])
        # A newcomer does not overtake the held ones even when a slot frees.
        late = asyncio.create_task(request(99))
        gate.release()
        await _settle()
        assert order == [0, 1] and gate.held == 2
        gate.set_capacity(10)
        await asyncio.gather(*tasks, late)
        assert order == [0, 1, 2, 99] and gate.in_flight == 3

    asyncio.run(main())


def test_bounds_refuse_with_the_reason() -> None:
    async def main() -> None:
        gate = Gate(GateConfig(max_held=1, max_wait_seconds=0.05, retry_after_seconds=7), "m")
        first = asyncio.create_task(gate.admit())
        await _settle()
        with pytest.raises(Refused) as over:
            await gate.admit()
        assert over.value.reason == "held_limit" and over.value.retry_after == 7
        assert "model m is starting" in over.value.message
        with pytest.raises(Refused) as late:
            await first
        assert late.value.reason == "wait_timeout"
        assert (gate.held, gate.in_flight) == (0, 0)

    asyncio.run(main())


def test_a_client_that_leaves_frees_its_place_or_its_slot() -> None:
    async def main() -> None:
        gate = Gate(GateConfig(max_held=5, max_wait_seconds=30), "m")
        held = asyncio.create_task(gate.admit())
        await _settle()
        held.cancel()
        await _settle()
        assert (gate.held, gate.in_flight) == (0, 0)
        gate.set_capacity(1)
        await gate.admit()
        assert gate.in_flight == 1 and gate.busy

    asyncio.run(main())


def test_a_deleted_model_fails_held_and_new_requests_until_it_is_back() -> None:
    async def main() -> None:
        gate = Gate(GateConfig(max_held=5, max_wait_seconds=30), "m")
        held = [asyncio.create_task(gate.admit()) for _ in range(2)]
        await _settle()
        gate.close("model m does not exist")
        for task in held:
            with pytest.raises(Refused, match="does not exist"):
                await task
        with pytest.raises(Refused) as new:
            await gate.admit()
        assert new.value.reason == "model_gone" and gate.held == 0
        gate.reopen()
        gate.set_capacity(1)
        await gate.admit()
        assert gate.in_flight == 1

    asyncio.run(main())


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        GateConfig(max_held=0, max_wait_seconds=1)
    with pytest.raises(ValueError):
        GateConfig(max_held=1, max_wait_seconds=0)
