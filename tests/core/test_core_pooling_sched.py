"""Pooling requests (embed, score) in the shared scheduler: whole prompts within the same token budget
and max_num_seqs as generation, no KV blocks, finished after their forward; abort and stats as usual."""

from __future__ import annotations

import pytest

from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, SchedulerOutput
from server.core.scheduler import Scheduler, SchedulerConfig
from server.request import FinishReason, PoolingParams, Request, RequestStatus, SamplingParams


def make_sched(budget: int = 16, seqs: int = 8, threshold: int = 0, blocks: int = 64) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=64,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(cfg, KVCacheManager(blocks, 4, enable_prefix_caching=False))


def gen(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def pool(rid: str, n: int, types: tuple[int, ...] | None = None) -> Request:
    return Request(rid, list(range(200, 200 + n)), SamplingParams(max_tokens=1), pooling=PoolingParams(types))


def run_step(s: Scheduler) -> tuple[SchedulerOutput, list[tuple[str, FinishReason]]]:
    out = s.schedule()
    mo = ModelOutput(sampled_token_ids={i.request.request_id: 7 for i in out.scheduled if i.sample})
    done = s.update_from_output(out, mo)
    return out, [(f.request.request_id, f.reason) for f in done]


def rows(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(i.request.request_id, i.num_new_tokens) for i in out.scheduled]


def test_pooling_request_runs_whole_once_and_holds_no_blocks() -> None:
    s = make_sched(budget=16)
    free = s.kv.pool.num_free_blocks
    s.add_request(pool("p", 10))
    out = s.schedule()
    assert rows(out) == [("p", 10)] and out.scheduled[0].block_ids == ()
    assert out.scheduled[0].sample  # the whole prompt: its result comes out of this step
    assert s.stats().num_running == 1 and s.kv.pool.num_free_blocks == free
    done = s.update_from_output(out, ModelOutput())  # nothing sampled for it
    assert [(f.request.request_id, f.reason) for f in done] == [("p", FinishReason.STOP)]
    assert not s.has_unfinished() and s.requests == {}
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.num_prompt_tokens, st.num_generation_tokens) == (0, 0, 10, 0)
    assert s.kv.pool.num_free_blocks == free


def test_pooling_requests_are_never_chunked() -> None:
    """A second pooling input that does not fit the rest of the budget waits for the next step whole
    (a generation prompt would get a chunk)."""
    s = make_sched(budget=16)
    s.add_request(pool("p1", 10))
    s.add_request(pool("p2", 10))
    out, done = run_step(s)
    assert rows(out) == [("p1", 10)] and done == [("p1", FinishReason.STOP)]
    assert s.stats().num_waiting == 1
    out, done = run_step(s)
    assert rows(out) == [("p2", 10)] and done == [("p2", FinishReason.STOP)]


def test_pooling_input_longer_than_a_step_or_the_model_is_refused() -> None:
    s = make_sched(budget=16)
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        s.add_request(pool("p", 17))
    s2 = make_sched(budget=128)
    s2.add_request(pool("ok", 64))  # the whole context is allowed: no token follows a pooled input
    with pytest.raises(ValueError, match="at most 64"):
        s2.add_request(pool("long", 65))
    with pytest.raises(ValueError, match="token_type_ids"):
        s2.add_request(pool("types", 4, (0, 0, 1)))
    assert [r.request_id for r in s2.waiting] == ["ok"]


def test_pooling_and_generation_share_the_budget_and_max_num_seqs() -> None:
    s = make_sched(budget=16, seqs=3)
    s.add_request(gen("g", 4, max_tokens=8))
    out, _ = run_step(s)  # g's prompt; g decodes from now on
    assert rows(out) == [("g", 4)]
    for rid, n in (("p1", 6), ("p2", 5), ("p3", 2), ("p4", 1)):
        s.add_request(pool(rid, n))
    s.add_request(gen("g2", 20))
    out, done = run_step(s)
    # g's decode (1) + p1 (6) + p2 (5) = 12 tokens; max_num_seqs 3 holds p3 back, and g2 behind it
    assert rows(out) == [("g", 1), ("p1", 6), ("p2", 5)]
    assert sorted(done) == [("p1", FinishReason.STOP), ("p2", FinishReason.STOP)]
    assert s.stats().num_running == 1 and s.stats().num_waiting == 3
    out, done = run_step(s)
    assert rows(out) == [("g", 1), ("p3", 2), ("p4", 1)]  # three rows again: g2 waits
    assert [rid for rid, _ in done] == ["p3", "p4"]
    out, done = run_step(s)
    assert rows(out) == [("g", 1), ("g2", 15)]  # a generation prompt is chunked to the budget's rest
    assert done == [] and {r.request_id for r in s.running} == {"g", "g2"}


def test_pooling_input_beyond_the_prefill_cap_runs_as_the_steps_first_prompt() -> None:
    """Beside decodes the step's prompt share is capped; a pooling input cannot be split, so it runs
    when it is the first prompt of a step, instead of starving behind the cap."""
    s = make_sched(budget=32, threshold=4)
    for n in range(3):  # more streams decode than prompts wait: the cap holds (not a burst)
        s.add_request(gen(f"g{n}", 2, max_tokens=8))
    run_step(s)
    s.add_request(pool("p", 9))
    s.add_request(pool("q", 2))
    decodes = [(f"g{n}", 1) for n in range(3)]
    out, done = run_step(s)
    assert rows(out) == [*decodes, ("p", 9)] and done == [("p", FinishReason.STOP)]
    out, done = run_step(s)
    assert rows(out) == [*decodes, ("q", 2)]


def test_abort_pooling_request_waiting_or_during_its_step() -> None:
    s = make_sched(budget=8)
    s.add_request(pool("a", 8))
    s.add_request(pool("b", 4))
    s.add_request(pool("c", 4))
    aborted = s.finish_request("c", FinishReason.ABORT)  # still waiting: it leaves the queue
    assert aborted is not None and aborted.status is RequestStatus.FINISHED
    assert [r.request_id for r in s.waiting] == ["a", "b"] and s.stats().num_waiting == 2
    out = s.schedule()
    assert rows(out) == [("a", 8)]
    s.finish_request("a", FinishReason.ABORT)  # aborted while its forward runs
    assert s.update_from_output(out, ModelOutput()) == []  # its result is dropped, not delivered
    out, done = run_step(s)
    assert rows(out) == [("b", 4)] and done == [("b", FinishReason.STOP)]
    assert out.finished_request_ids == ["a"]  # the worker is told, as for an aborted generation
    assert not s.has_unfinished()


def test_failed_pooling_forward_ends_the_request_with_error() -> None:
    s = make_sched()
    s.add_request(pool("p", 3))
    out = s.schedule()
    done = s.update_from_output(out, ModelOutput(errors={"p": "RuntimeError: boom"}))
    assert [(f.request.request_id, f.reason, f.request.error) for f in done] == [
        ("p", FinishReason.ERROR, "RuntimeError: boom")
    ]
    assert not s.has_unfinished()


def test_pooling_steps_keep_to_their_token_target() -> None:
    """64 texts arrive together (one client each, issue 49 item 5): with a pooling token target a step
    takes texts whole, in arrival order, while they fit the target, so the first answers come after a
    fraction of the burst's work instead of all 64 at the end of one step; an input longer than the
    target still runs, alone, as a step's first. The budget stays the model's whole context."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096, pooling_step_tokens=512
    )
    s = Scheduler(cfg, KVCacheManager(1, 16, enable_prefix_caching=False))
    for i in range(64):
        s.add_request(pool(f"p{i}", 30))
    s.add_request(pool("long", 700))
    s.add_request(pool("after", 30))
    steps: list[list[tuple[str, int]]] = []
    while s.has_unfinished():
        out, done = run_step(s)
        assert {rid for rid, _ in done} == {rid for rid, _ in rows(out)}
        steps.append(rows(out))
    assert [len(r) for r in steps[:4]] == [17, 17, 17, 13]  # 510, 510, 510, 390 tokens
    assert steps[4] == [("long", 700)] and steps[5] == [("after", 30)]
    assert [rid for r in steps for rid, _ in r] == [*(f"p{i}" for i in range(64)), "long", "after"]


def test_pooling_step_tokens_validated() -> None:
    with pytest.raises(ValueError, match="pooling_step_tokens"):
        SchedulerConfig(pooling_step_tokens=-1)
