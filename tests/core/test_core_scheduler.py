"""Scheduler behaviour with a fake model: token budget, chunked prefill, preemption, abort."""

from __future__ import annotations

import pytest

from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, SchedulerOutput
from server.core.scheduler import Scheduler, SchedulerConfig
from server.request import FinishReason, Request, RequestStatus, SamplingParams


def make_sched(
    blocks: int = 64, bs: int = 4, budget: int = 32, seqs: int = 8, caching: bool = True
) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=256)
    return Scheduler(cfg, KVCacheManager(blocks, bs, caching))


def req(rid: str, n: int, max_tokens: int = 4, **kw: object) -> Request:
    return Request(
        rid,
        list(range(100, 100 + n)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
        eos_token_ids=frozenset({2}),
    )


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    mo = ModelOutput(sampled_token_ids={i.request.request_id: token for i in out.scheduled if i.sample})
    s.update_from_output(out, mo)
    return out


def test_running_first_then_waiting_within_budget() -> None:
    s = make_sched(budget=10, caching=False)
    s.add_request(req("a", 6))
    out = run_step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 6)]
    s.add_request(req("b", 20))
    out = run_step(s)
    # a decodes one token first, then b gets the rest of the budget as a prefill chunk
    assert [(i.request.request_id, i.num_new_tokens, i.sample) for i in out.scheduled] == [
        ("a", 1, True),
        ("b", 9, False),
    ]
    out = run_step(s)
    assert [(i.request.request_id, i.num_new_tokens, i.sample) for i in out.scheduled] == [
        ("a", 1, True),
        ("b", 9, False),
    ]
    out = run_step(s)  # a's 4th token ends it (max_tokens=4); b's last chunk samples its first token
    assert [(i.request.request_id, i.num_new_tokens, i.sample) for i in out.scheduled] == [
        ("a", 1, True),
        ("b", 2, True),
    ]
    assert s.requests.keys() == {"b"}


def test_max_num_seqs_limits_admission() -> None:
    s = make_sched(seqs=2)
    for r in ("a", "b", "c"):
        s.add_request(req(r, 3))
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_eos_and_stop_tokens_and_length() -> None:
    s = make_sched()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("stoptok", 3, max_tokens=10, stop_token_ids=(9,)))
    s.add_request(req("ign", 3, max_tokens=2, ignore_eos=True))
    out = s.schedule()
    fin = s.update_from_output(out, ModelOutput(sampled_token_ids={"eos": 2, "stoptok": 9, "ign": 2}))
    assert {(f.request.request_id, f.reason) for f in fin} == {
        ("eos", FinishReason.STOP),
        ("stoptok", FinishReason.STOP),
    }
    out = run_step(s, token=2)
    assert s.requests == {}
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_preemption_frees_the_latest_request_and_recomputes_it() -> None:
    s = make_sched(blocks=4, bs=4, budget=64, caching=False)
    s.add_request(req("a", 7, max_tokens=8))  # 2 blocks
    s.add_request(req("b", 7, max_tokens=8))  # 2 blocks: the pool is full
    run_step(s)
    assert s.kv.pool.num_free_blocks == 0
    assert run_step(s).preempted_request_ids == []  # token 8 still fits in 2 blocks
    out = run_step(s)  # a needs a 3rd block for token 9: b, admitted last, is preempted
    assert out.preempted_request_ids == ["b"]
    b = next(r for r in s.waiting if r.request_id == "b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7]  # sampled tokens survive; the KV is recomputed
    while s.running and s.running[0].request_id == "a":
        run_step(s)
    out = run_step(s)
    # b comes back with its prompt + kept output recomputed in one chunk
    assert [(i.request.request_id, i.start, i.num_new_tokens) for i in out.scheduled] == [("b", 0, 9)]
    assert s.num_preemptions == 1


def test_abort_waiting_and_running_frees_blocks() -> None:
    s = make_sched()
    s.add_request(req("a", 5))
    run_step(s)
    s.add_request(req("b", 5))
    assert s.finish_request("a", FinishReason.ABORT) is not None
    assert s.finish_request("b", FinishReason.ABORT) is not None
    assert s.finish_request("b", FinishReason.ABORT) is None  # idempotent
    assert not s.has_unfinished()
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    assert sorted(s.schedule().finished_request_ids) == ["a", "b"]


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    s = make_sched(bs=4)
    s.add_request(req("a", 13))
    run_step(s)
    s.add_request(req("b", 13))
    out = s.schedule()
    b = next(i for i in out.scheduled if i.request.request_id == "b")
    assert (b.start, b.num_new_tokens) == (12, 1)
    assert s.stats().prefix_cache_hits == 12


def test_request_that_can_never_fit_is_rejected() -> None:
    s = make_sched(blocks=2, bs=4)
    with pytest.raises(ValueError, match="never fit"):
        s.add_request(req("big", 6, max_tokens=10))
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(Request("empty", [], SamplingParams()))


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)


def _rows(out: SchedulerOutput) -> dict[str, int]:
    return {i.request.request_id: i.num_new_tokens for i in out.scheduled}


def test_decodes_run_every_step_while_a_long_prompt_arrives() -> None:
    """Issue 31: a step's prefill share is bounded while streams decode, so each decode's next token
    waits for at most `long_prefill_token_threshold` prompt tokens, not the whole budget."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, long_prefill_token_threshold=8
    )
    s = Scheduler(cfg, KVCacheManager(128, 4, False))
    for n in range(3):
        s.add_request(req(f"d{n}", 5, max_tokens=50))
    first = run_step(s)  # nobody decodes yet: the prompts take the whole budget
    assert _rows(first) == {"d0": 5, "d1": 5, "d2": 5}
    s.add_request(req("long", 100, max_tokens=2))
    s.add_request(req("short", 6, max_tokens=2))
    prompt_done = 0
    for _ in range(20):
        out = run_step(s)
        rows = _rows(out)
        assert all(rows.get(f"d{n}") == 1 for n in range(3)), rows  # every stream, every step
        prefill = sum(v for k, v in rows.items() if not k.startswith("d"))
        assert prefill <= 8, rows
        prompt_done += prefill
    # The prompts still make progress at the capped rate (all 8 prompt tokens used each step).
    assert prompt_done == 20 * 8 or "long" not in s.requests


def test_a_burst_of_prompts_is_not_trickled_beside_decodes() -> None:
    """While at least as many prompts wait as streams decode, the step takes them up to the whole budget
    (holding each back a cap's worth per step costs them more than one long step costs the streams);
    fewer waiting than decoding: capped as before."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=16, max_model_len=256, long_prefill_token_threshold=8
    )
    s = Scheduler(cfg, KVCacheManager(256, 4, False))
    for n in range(3):
        s.add_request(req(f"d{n}", 5, max_tokens=50))
    run_step(s)
    for n in range(4):  # 4 waiting >= 3 decoding: a burst
        s.add_request(req(f"p{n}", 12, max_tokens=50))
    assert _rows(run_step(s)) == {"d0": 1, "d1": 1, "d2": 1, "p0": 12, "p1": 12, "p2": 12, "p3": 12}
    s.add_request(req("late", 12, max_tokens=2))  # 1 waiting, 7 decoding: capped
    assert _rows(run_step(s)) == {
        **{f"d{n}": 1 for n in range(3)},
        **{f"p{n}": 1 for n in range(4)},
        "late": 8,
    }


@pytest.mark.parametrize("seats", [4, 16])
def test_a_burst_lifts_the_cap_for_admissions_only(seats: int) -> None:
    """A prompt already running (the rest of a long one) keeps the cap in a burst, and prompts that cannot
    be admitted (no free seat under max_num_seqs) make no burst."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=seats, max_model_len=512, long_prefill_token_threshold=8
    )
    s = Scheduler(cfg, KVCacheManager(256, 4, False))
    for n in range(3):
        s.add_request(req(f"d{n}", 5, max_tokens=50))
    run_step(s)
    s.add_request(req("long", 300, max_tokens=2))
    run_step(s)  # 1 waiting < 3 decoding: its first 8 tokens
    for n in range(3):
        s.add_request(req(f"p{n}", 6, max_tokens=50))
    rows = _rows(run_step(s))
    assert rows["long"] == 8  # running: capped either way
    if seats == 4:  # no free seat: no burst, nobody admitted
        assert set(rows) == {"d0", "d1", "d2", "long"}
    else:  # 3 admissible >= 3 decoding: all three admitted whole beside the capped chunk
        assert {k: v for k, v in rows.items() if k.startswith("p")} == {"p0": 6, "p1": 6, "p2": 6}


def test_prefill_cap_off_or_idle_uses_the_whole_budget() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    s = Scheduler(cfg, KVCacheManager(128, 4, False))
    s.add_request(req("d", 5, max_tokens=50))
    run_step(s)
    s.add_request(req("long", 100))
    assert _rows(run_step(s)) == {"d": 1, "long": 63}  # 0 = no cap (the old behaviour)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    # Without chunked prefill there is no cap (a prompt runs whole or never).
    whole = SchedulerConfig(
        max_num_batched_tokens=256,
        max_model_len=256,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=8,
    )
    s = Scheduler(whole, KVCacheManager(128, 4, False))
    s.add_request(req("d", 5, max_tokens=50))
    run_step(s)
    s.add_request(req("long", 100))
    assert _rows(run_step(s)) == {"d": 1, "long": 100}


def test_long_prompts_in_a_burst_get_the_cap_oldest_first() -> None:
    """Issue 49: a burst lifts the cap only for prompts that finish their prefill in the step. Prompts
    longer than the step's budget get the ordinary cap's share, oldest first: before, each was admitted
    with the rest of the budget and then trickled at the cap behind the older ones, so every prompt
    finished late and every step beside the decodes took the whole budget (8 users x 3,000 tokens:
    TTFT p50 14.2 s). The decodes run every step throughout."""
    cap = 8
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=16, max_model_len=256, long_prefill_token_threshold=cap
    )
    s = Scheduler(cfg, KVCacheManager(256, 4, False))
    for n in range(3):
        s.add_request(req(f"d{n}", 5, max_tokens=200))
    run_step(s)
    for n in range(4):  # 4 waiting >= 3 decoding: a burst, but no prompt fits in one step
        s.add_request(req(f"p{n}", 100, max_tokens=2))
    first_token: dict[str, int] = {}
    for step in range(60):
        out = run_step(s)
        rows = _rows(out)
        assert all(rows.get(f"d{n}") == 1 for n in range(3)), (step, rows)  # never starved
        assert sum(v for k, v in rows.items() if k.startswith("p") and k not in first_token) <= cap, (
            step,
            rows,
        )
        for i in out.scheduled:
            if i.sample and i.request.request_id.startswith("p"):
                first_token.setdefault(i.request.request_id, step)
        if len(first_token) == 4:
            break
    assert list(first_token) == ["p0", "p1", "p2", "p3"]  # prefills finish in arrival order
    # FCFS at the cap rate: the oldest needs ceil(100 / 8) steps, each next one 100 / 8 more
    assert first_token["p0"] == 12 and first_token["p3"] == 49, first_token


def test_a_burst_admits_first_come_first_served() -> None:
    """FCFS in a burst: a prompt that cannot finish in the step takes what is left of the cap, and the
    waiting behind it wait (vLLM fills the budget first come, first served); a prompt that fits whole is
    still admitted beside a long one's capped chunk."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=16, max_model_len=256, long_prefill_token_threshold=8
    )
    s = Scheduler(cfg, KVCacheManager(256, 4, False))
    s.add_request(req("d0", 5, max_tokens=100))
    run_step(s)
    s.add_request(req("long0", 100, max_tokens=2))
    s.add_request(req("short0", 6, max_tokens=2))
    assert _rows(run_step(s)) == {"d0": 1, "long0": 8, "short0": 6}  # 2 waiting >= 1 decoding
    s.add_request(req("long1", 100, max_tokens=2))
    s.add_request(req("short1", 6, max_tokens=2))
    # long0 (running) takes the whole cap: long1 waits for it, and short1 waits behind long1
    for _ in range(10):
        rows = _rows(run_step(s))
        assert rows == {"d0": 1, "long0": 8, "short0": 1} or rows == {"d0": 1, "long0": 8}, rows
