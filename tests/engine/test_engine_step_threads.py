"""Generation steps on CPU run with the thread count measured fastest for their size
(server/core/step_threads.py, `--thread-policy`), and the outputs do not depend on it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(folder: Path, policy: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=64),
            num_threads=2,
            thread_policy=policy,
        )
    )


def run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list[int]]:
    """Greedy outputs per request, and the thread count the model ran each step with."""
    seen: list[int] = []
    real = engine.runner.execute

    def spy(sched):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return real(sched)

    engine.runner.execute = spy  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.runner.execute = real  # type: ignore[method-assign]
    return out, seen


@pytest.fixture()
def restore_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restore_threads")
def test_adaptive_steps_follow_the_measured_costs(tiny_model_factory: Callable[..., Path]) -> None:
    engine = make_engine(tiny_model_factory("llama"), "adaptive")
    assert engine.step_threads is not None and engine.step_threads.candidates == (1, 2)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    # Two threads measured far slower for decode-sized steps (a loaded machine): decode steps run on one.
    for tokens in (1, 2, 3):
        for _ in range(5):  # a full window of samples each (the cost is their median)
            engine.step_threads.record(tokens, 2, 1.0)
            engine.step_threads.record(tokens, 1, 0.001)
    out, seen = run(engine, prompts)
    assert all(len(v) == 6 for v in out.values())
    # the prefill step (8 tokens) is a bucket of its own, untried: it starts on the count that leads for
    # the nearest measured size (one thread), not on an untried count
    assert seen == [1] * len(seen)
    assert engine.last_step_threads == 1
    # and the other way round: one thread measured slower, decode steps run on two
    for tokens in (1, 2, 3):
        for _ in range(5):
            engine.step_threads.record(tokens, 1, 5.0)
    out2, seen2 = run(engine, [[5, 6, 7, 8], [9, 10, 11, 12]])
    assert seen2[1:] == [2] * (len(seen2) - 1)
    assert out2 == out  # same tokens whichever count ran


@pytest.mark.usefixtures("restore_threads")
def test_fixed_policy_keeps_num_threads(tiny_model_factory: Callable[..., Path]) -> None:
    engine = make_engine(tiny_model_factory("llama"), "fixed")
    assert engine.step_threads is not None and engine.step_threads.candidates == (2,)
    for tokens in (1, 2, 3):
        engine.step_threads.record(tokens, 1, 0.0)  # not a candidate: ignored
    _, seen = run(engine, [[5, 6, 7, 8], [9, 10, 11, 12]])
    assert seen == [2] * len(seen)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="thread_policy"):
        EngineConfig(thread_policy="spin")


def test_probes_back_off_while_they_confirm_the_best_and_reset_when_it_changes() -> None:
    from server.core.step_threads import StepThreads

    policy = StepThreads(2, explore_every=4, max_explore_every=32)
    cost = {1: 0.5e-3, 2: 2e-3}  # a loaded machine: one thread is faster, probes of two confirm it
    probes, last = [], 2
    for step in range(1, 200):
        t = policy.choose(16)
        policy.record(16, t, cost[t] * 16)
        if t == 2 and last == 1:
            probes.append(step)  # a probe starts: two steps on two threads, the second the sample
        last = t
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:4] == [9, 17, 33, 33]  # the interval doubles from 4 up to 32 (+1: the probe's 2nd step)
    # the neighbours leave: two threads become faster; the next probe finds it and probing speeds up
    cost = {1: 2e-3, 2: 0.5e-3}
    chosen = []
    for _ in range(64):
        t = policy.choose(16)
        policy.record(16, t, cost[t] * 16)
        chosen.append(t)
    assert policy.best(16) == 2
    assert chosen[-16:].count(2) >= 14


def test_the_first_step_after_a_switch_is_not_a_sample() -> None:
    """A probe of another count pays for waking its workers on its first step: that step must not make
    the count look slower than it is (an idle machine otherwise settled on one thread)."""
    from server.core.step_threads import StepThreads

    policy = StepThreads(2, explore_every=4, max_explore_every=32)
    chosen: list[int] = []

    def run(cost: dict[int, float], steps: int) -> None:
        for _ in range(steps):
            t = policy.choose(16)
            switched = bool(chosen) and chosen[-1] != t
            # a switch costs 4x the step: were it recorded, two threads would always look slower
            policy.record(16, t, cost[t] * 16 * (4 if switched else 1))
            chosen.append(t)

    run({1: 1e-3, 2: 4e-3}, 30)  # a loaded machine: one thread is faster
    assert policy.best(16) == 1
    run({1: 2e-3, 2: 1e-3}, 200)  # the neighbours left: two threads are faster once running
    assert policy.best(16) == 2
    assert chosen[-40:].count(2) >= 36


def _waves(policy, prefill: dict[int, float], decode: dict[int, float], waves: int) -> list[int]:  # type: ignore[no-untyped-def]
    """`waves` x (one 2048-token prefill step, then 63 16-row decode steps), seconds per token given per
    thread count; a switch of count adds 2 ms to its step (waking workers). Returns the prefills' counts."""
    counts, last = [], None
    for _ in range(waves):
        for tokens, cost in [(2048, prefill)] + [(16, decode)] * 63:
            t = policy.choose(tokens)
            policy.record(tokens, t, cost[t] * tokens + (2e-3 if last not in (None, t) else 0.0))
            last = t
            if tokens == 2048:
                counts.append(t)
    return counts


def test_a_long_step_size_between_others_is_not_run_on_the_slow_count_every_time() -> None:
    """A 16-user wave: one 2048-token prefill step (1.8 s on two threads, 3 s on one) between runs of
    decode steps. The prefill step nearly always follows a step on another count; were a switched long
    step never a sample, its untried count would be tried again at every wave (seen: each wave's
    prefill on one thread, its TTFT +1.2 s). A switch's cost is nothing beside a long step."""
    from server.core.step_threads import StepThreads

    policy = StepThreads(2, explore_every=16, max_explore_every=256)
    idle = {1: 1.5e-3, 2: 0.9e-3}
    counts = _waves(policy, idle, {1: 2e-3, 2: 1e-3}, 40)
    assert policy.best(2048) == 2
    assert counts.count(1) <= 2, counts  # the regular probes only, one step each
    # decode steps become faster on one thread (a busy neighbour): the prefill's own measurements decide
    counts = _waves(policy, idle, {1: 1e-3, 2: 2e-3}, 20)
    assert policy.best(16) == 1 and policy.best(2048) == 2
    assert counts.count(1) <= 2, counts
    # and a loaded machine where the prefill too is faster on one thread is found by the regular probes
    # (by then one every 64 prefills: a long step's one sample is its bucket's cost for that count)
    counts = _waves(policy, {1: 0.9e-3, 2: 1.5e-3}, {1: 1e-3, 2: 2e-3}, 100)
    assert policy.best(2048) == 1
    assert counts[-20:].count(1) >= 19, counts


def test_a_size_that_always_follows_another_count_still_gets_samples() -> None:
    """A sequential client's texts of varying length: a rare size's steps each follow a step of a common
    size, which runs on the count that leads for it. A count tried for the rare size was then never a fair
    sample (the first step after a switch is not one), stayed untried, and ran every time that size came
    (seen served: 1 of 4 one-text steps of a Qwen3-Embedding-0.6B shape on one thread, 85 ms against 48).
    Its second such step stands in until a fair one comes: after that, the slow count runs only on the
    regular probes."""
    from server.core.step_threads import StepThreads

    policy = StepThreads(2, max_explore_every=256, hint_new_buckets=False)
    chosen, last = [], None
    for step in range(400):
        tokens = 12 if step % 4 == 3 else 24  # a rare size, each step of it after the common one's
        t = policy.choose(tokens)
        seconds = (0.010 + 0.0011 * tokens) * (1.8 if t == 1 else 1.0)
        policy.record(tokens, t, seconds * (1.5 if last not in (None, t) else 1.0))
        if tokens == 12:
            chosen.append(t)
        last = t
    assert policy.best(12) == 2 and policy.best(24) == 2
    assert chosen[10:].count(1) <= 6, chosen  # of 90 rare steps: the probes (2 steps each) only
