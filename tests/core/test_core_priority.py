"""--scheduling-policy priority (vLLM's): waiting order by (priority, arrival), better levels preempt
worse ones for seats and blocks, growth preemption takes the worst running request, fcfs refuses a
non-zero priority, and the lowest level's starvation under sustained better load (documented, strict)."""

from __future__ import annotations

import itertools

import pytest

from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, SchedulerOutput
from server.core.request_queue import RequestQueue
from server.core.scheduler import Scheduler, SchedulerConfig
from server.request import Request, RequestStatus, SamplingParams

_clock = itertools.count()


def make_sched(
    blocks: int = 64, bs: int = 4, budget: int = 64, seqs: int = 8, policy: str = "priority"
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=256,
        scheduling_policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(cfg, KVCacheManager(blocks, bs, False))


def req(rid: str, n: int, priority: int = 0, max_tokens: int = 8) -> Request:
    # Arrival times strictly increasing in creation order, whatever the clock's resolution.
    return Request(
        rid,
        list(range(100, 100 + n)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        eos_token_ids=frozenset({2}),
        arrival_time=float(next(_clock)),
        priority=priority,
    )


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    mo = ModelOutput(sampled_token_ids={i.request.request_id: 7 for i in out.scheduled if i.sample})
    s.update_from_output(out, mo)
    return out


def ids(out: SchedulerOutput) -> list[str]:
    return [i.request.request_id for i in out.scheduled]


def test_waiting_order_is_priority_then_arrival() -> None:
    q = RequestQueue("priority")
    for rid, p in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        q.add(req(rid, 2, p))
    assert [r.request_id for r in q] == ["d", "b", "e", "a", "c"]
    fcfs = RequestQueue("fcfs")
    for rid, p in (("a", 5), ("b", 0)):
        fcfs.add(req(rid, 2, p))
    assert [r.request_id for r in fcfs] == ["a", "b"]
    with pytest.raises(ValueError, match="scheduling policy"):
        RequestQueue("lifo")  # type: ignore[arg-type]


def test_a_better_level_takes_a_seat_from_a_worse_one_in_the_same_step() -> None:
    s = make_sched(seqs=2)
    s.add_request(req("batch1", 4, priority=10))
    s.add_request(req("batch2", 4, priority=10))
    run_step(s)
    s.add_request(req("chat", 4, priority=0))
    out = run_step(s)
    # batch2 (the worst level, admitted last) made room; chat was admitted in this step
    assert out.preempted_request_ids == ["batch2"]
    assert ids(out) == ["batch1", "chat"]
    victim = s.requests["batch2"]
    assert victim.status == RequestStatus.PREEMPTED and victim in s.waiting
    # chat never waits behind batch2 again; batch2 resumes once a seat frees
    while "chat" in s.requests:
        run_step(s)
    for _ in range(10):
        run_step(s)
    assert "batch2" not in s.requests or s.requests["batch2"].status == RequestStatus.RUNNING


def test_equal_levels_do_not_preempt_each_other() -> None:
    s = make_sched(seqs=2)
    s.add_request(req("a", 4, priority=3))
    s.add_request(req("b", 4, priority=3))
    run_step(s)
    s.add_request(req("c", 4, priority=3))
    out = run_step(s)
    assert out.preempted_request_ids == [] and ids(out) == ["a", "b"]


def test_a_better_level_takes_blocks_from_worse_ones_and_their_tokens_go_back_to_the_budget() -> None:
    # 6 blocks of 4: two batch requests of 11 tokens hold 3 blocks each; the 8-token chat needs 2.
    s = make_sched(blocks=6, bs=4, budget=64)
    s.add_request(req("batch1", 11, priority=9))
    s.add_request(req("batch2", 11, priority=9))
    run_step(s)
    assert s.kv.pool.num_free_blocks == 0
    s.add_request(req("chat", 8, priority=1))
    out = s.schedule()
    assert out.preempted_request_ids == ["batch2"]
    # batch2 had been scheduled for its decode in this step before chat took its place: it is gone from
    # the step, and the step's token count is what the remaining rows use
    assert ids(out) == ["batch1", "chat"]
    assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled) == 1 + 8


def test_growth_preempts_the_worst_running_request_not_the_last_admitted() -> None:
    s = make_sched(blocks=4, bs=4, budget=64)
    s.add_request(req("low", 7, priority=5, max_tokens=8))
    s.add_request(req("high", 7, priority=0, max_tokens=8))
    run_step(s)
    run_step(s)  # token 8 still fits in 2 blocks each
    out = run_step(s)  # both need a third block: the worst level goes, though it was admitted first
    assert out.preempted_request_ids == ["low"]
    assert ids(out) == ["high"]


def test_fcfs_preemption_is_unchanged_and_refuses_a_priority() -> None:
    s = make_sched(blocks=4, bs=4, policy="fcfs")
    s.add_request(req("a", 7, max_tokens=8))
    s.add_request(req("b", 7, max_tokens=8))
    run_step(s)
    run_step(s)
    assert run_step(s).preempted_request_ids == ["b"]  # the last admitted, as before
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        s.add_request(req("c", 3, priority=1))
    s.check_priority(0)  # 0 is everyone's default


def test_the_worst_level_waits_while_better_ones_keep_the_seats_full() -> None:
    """Strict priority (request_queue.py): with one seat and a steady stream of better requests, the
    worst level is admitted only once the stream stops."""
    s = make_sched(seqs=1)
    s.add_request(req("background", 3, priority=100, max_tokens=2))
    s.add_request(req("fg0", 3, priority=0, max_tokens=2))
    admitted: list[str] = []
    for k in range(1, 6):
        out = run_step(s)
        admitted += [i.request.request_id for i in out.scheduled if i.start == 0]
        s.add_request(req(f"fg{k}", 3, priority=0, max_tokens=2))
    assert "background" not in admitted
    for _ in range(30):
        out = run_step(s)
        admitted += [i.request.request_id for i in out.scheduled if i.start == 0]
    assert admitted[-1] == "background" and not s.has_unfinished()
