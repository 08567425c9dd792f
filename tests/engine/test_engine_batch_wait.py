"""AsyncEngine's burst gathering (`--batch-wait-ms`): after an idle spell the first step waits until
arrivals pause, so requests arriving together start in one step; a steady stream cannot hold it back
for more than 8 waits; busy engines never wait."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

import server.engine as engine_module
from server.config import EngineConfig
from server.core.outputs import RequestOutput
from server.engine import AsyncEngine
from server.request import SamplingParams


class _Core:
    """The EngineCore surface AsyncEngine uses; each step finishes every request it holds (one token) and
    records how many that was. `hold` makes steps block until released (a long step in progress)."""

    speculator = None

    def __init__(self) -> None:
        self.held: list[str] = []
        self.step_sizes: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.trims: list[int] = []  # the steps taken when each idle trim came

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, lora: object = None) -> None:
        pass

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: object,
        lora: object,
        pooling: object,
        priority: int = 0,
    ) -> None:
        self.held.append(request_id)

    def check_priority(self, priority: int) -> None:
        pass

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return None

    def has_unfinished(self) -> bool:
        return bool(self.held)

    def stats(self) -> object:
        return None

    def step(self) -> list[RequestOutput]:
        self.hold.wait(10)
        self.step_sizes.append(len(self.held))
        done, self.held = self.held, []
        return [RequestOutput(rid, [1], "x", True) for rid in done]

    def reset_prefix_cache(self) -> bool:
        return True

    def check_health(self) -> None:
        pass

    def release_idle_memory(self) -> int | None:
        self.trims.append(len(self.step_sizes))
        return None

    def close(self, graceful: bool = True) -> None:
        pass


async def _arrivals(engine: AsyncEngine[_Core], gaps_s: list[float]) -> None:
    async def one() -> None:
        async for _ in engine.generate([1, 2], SamplingParams(max_tokens=1)):
            pass

    tasks = []
    for gap in gaps_s:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(gap)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)


def _drive(core: _Core, wait_s: float, body: Callable[[AsyncEngine[_Core]], Awaitable[None]]) -> None:
    """Runs `body` against a started AsyncEngine over `core`, and shuts the engine down after it."""

    async def main() -> None:
        engine = AsyncEngine(core, batch_wait_s=wait_s)
        engine.start()
        try:
            await body(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _run(core: _Core, wait_s: float, gaps_s: list[float]) -> list[int]:
    _drive(core, wait_s, lambda engine: _arrivals(engine, gaps_s))
    return core.step_sizes


def test_a_burst_after_idle_starts_in_one_step() -> None:
    # four requests 50 ms apart: without a wait each is its own step; with a 1 s wait all four are one
    assert _run(_Core(), 0.0, [0.05] * 4) == [1, 1, 1, 1]
    assert _run(_Core(), 1.0, [0.05] * 4) == [4]


def test_a_steady_stream_cannot_hold_the_first_step_back() -> None:
    # arrivals every 20 ms for 2 s against a 100 ms wait: the first step starts by 8 waits (~800 ms)
    sizes = _run(_Core(), 0.1, [0.02] * 100)
    assert sum(sizes) == 100
    assert 1 < sizes[0] < 100, sizes


def test_a_busy_engine_does_not_wait() -> None:
    """A request arriving during a step joins the next step with no wait: only an idle engine gathers."""
    core = _Core()
    gathers: list[int] = []

    async def main() -> None:
        engine = AsyncEngine(core, batch_wait_s=0.05)
        real = engine._gather_burst

        def counted() -> bool:
            gathers.append(len(core.held))
            return real()

        engine._gather_burst = counted  # type: ignore[method-assign]
        engine.start()
        try:
            core.hold.clear()  # steps block until released
            first = asyncio.create_task(_arrivals(engine, [0.0]))
            while not core.held or not engine._commands.empty():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the first step is now blocked in progress
            second = asyncio.create_task(_arrivals(engine, [0.0]))
            await asyncio.sleep(0.2)
            core.hold.set()
            await asyncio.wait_for(asyncio.gather(first, second), 30)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert core.step_sizes == [1, 1] and gathers == [1]


def test_shutdown_during_the_wait_is_prompt() -> None:
    async def main() -> float:
        engine = AsyncEngine(_Core(), batch_wait_s=10.0)
        engine.start()
        task = asyncio.create_task(_arrivals(engine, [0.0]))
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await engine.shutdown()
        task.cancel()
        return loop.time() - t0

    assert asyncio.run(main()) < 10.0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_waits_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="batch_wait_ms"):
        EngineConfig(batch_wait_ms=bad)
    if bad < 0:
        with pytest.raises(ValueError, match="batch_wait_s"):
            AsyncEngine(_Core(), batch_wait_s=bad)


def test_an_idle_engine_hands_its_freed_heap_back_once_per_idle_spell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """IDLE_TRIM_S after the last step the loop calls release_idle_memory, once per idle spell, never while
    requests keep coming (a Gemma-3-1B Q4_K_M server at rest: 1,552 -> 1,453 MiB)."""
    monkeypatch.setattr(engine_module, "IDLE_TRIM_S", 0.6)
    core = _Core()

    async def body(engine: AsyncEngine[_Core]) -> None:
        await asyncio.sleep(1.5)  # idle from the start, but no step yet: nothing freed, no trim
        await _arrivals(engine, [0.1] * 8)  # steps 0.1 s apart: no trim between them
        assert core.trims == []
        await asyncio.sleep(1.8)  # one idle spell of 1.8 s: one trim
        assert core.trims == [8]
        await _arrivals(engine, [0.0])
        await asyncio.sleep(1.8)

    _drive(core, 0.0, body)
    assert core.trims == [8, 9]


def test_a_step_longer_than_the_idle_wait_is_no_idle_spell(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle time counts from a step's end: a request arriving 0.2 s after a 1 s step finds no trim
    between them, however long that step took."""
    monkeypatch.setattr(engine_module, "IDLE_TRIM_S", 0.6)
    core = _Core()

    async def body(engine: AsyncEngine[_Core]) -> None:
        core.hold.clear()  # the first step blocks until released
        first = asyncio.create_task(_arrivals(engine, [0.0]))
        await asyncio.sleep(1.0)
        core.hold.set()
        await asyncio.wait_for(first, 30)
        await asyncio.sleep(0.2)
        await _arrivals(engine, [0.0])
        assert core.trims == []
        await asyncio.sleep(1.5)

    _drive(core, 0.0, body)
    assert core.trims == [2]
