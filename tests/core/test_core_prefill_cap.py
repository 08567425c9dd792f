"""The prefill share cap sized from measured step costs (server/core/prefill_cap.py), alone and driving the
scheduler in a closed loop under a step-cost model whose prompt tokens cost more as the context grows
(attention over the cached prefix), as on a CPU."""

from __future__ import annotations

import pytest

from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, SchedulerOutput
from server.core.prefill_cap import AdaptivePrefillCap, PrefillCapConfig, StepShape, step_shape
from server.core.scheduler import Scheduler, SchedulerConfig
from server.request import FinishReason, Request, SamplingParams


def test_cap_from_measured_costs() -> None:
    """cap = ((f - 1) d - o) / c from a quiet step d and mixed steps d + o + c P; before both are
    measured, `initial`; the floor where even o alone exceeds (f - 1) d; never above the ceiling."""
    cfg = PrefillCapConfig(itl_factor=2.0, initial=128, min_tokens=16, max_tokens=2048)
    cap = AdaptivePrefillCap(cfg)
    assert cap.cap(1) == 128
    d, o, c = 0.020, 0.004, 0.0005
    for _ in range(4):
        cap.observe(StepShape(decodes=1, prompt_tokens=0), d)
    assert cap.cap(1) == 128  # no mixed step yet
    for p in (128, 48, 32, 128):
        cap.observe(StepShape(decodes=1, prompt_tokens=p), d + o + c * p)
    assert cap.cap(1) == pytest.approx((d - o) / c, abs=1)  # 32
    # 16 decodes: their own quiet step (4x), the same per-token cost: a larger cap
    for _ in range(4):
        cap.observe(StepShape(decodes=16, prompt_tokens=0), 4 * d)
    assert cap.cap(16) == pytest.approx((4 * d - o) / c, abs=1)  # 152
    assert cap.cap(9) == cap.cap(16)  # same bucket
    assert cap.cap(1) == pytest.approx((d - o) / c, abs=1)
    # a prompt token far dearer (a long context): down to the floor, never below
    slow = AdaptivePrefillCap(cfg)
    slow.observe(StepShape(1, 0), d)
    slow.observe(StepShape(1, 64), d + 0.1)
    assert slow.cap(1) == 16
    # cheap ones: up to the ceiling, at most twice the largest chunk measured per step
    fast = AdaptivePrefillCap(PrefillCapConfig(max_tokens=256))
    fast.observe(StepShape(1, 0), d)
    fast.observe(StepShape(1, 64), d + 64e-6)
    assert fast.cap(1) == 128
    fast.observe(StepShape(1, 128), d + 128e-6)
    assert fast.cap(1) == 256
    # steps without decodes and empty timings say nothing
    fast.observe(StepShape(0, 512), 5.0)
    fast.observe(StepShape(1, 64), 0.0)
    assert fast.cap(1) == 256


def test_cap_config_is_validated() -> None:
    for kw, field in (
        ({"itl_factor": 1.0}, "itl_factor"),
        ({"min_tokens": 0}, "min_tokens"),
        ({"min_tokens": 64, "max_tokens": 32, "initial": 32}, "max_tokens"),
        ({"initial": 4096}, "initial"),
        ({"window": 1}, "window"),
    ):
        with pytest.raises(ValueError, match=field):
            PrefillCapConfig(**kw)  # type: ignore[arg-type]


QUIET, OVERHEAD, PER_TOKEN, PER_ATTN = 0.010, 0.002, 0.0002, 2e-8


def step_cost(out: SchedulerOutput) -> float:
    """Seconds of a step on a CPU-like model: a decode-only step costs QUIET, a step with prompt tokens
    also OVERHEAD + PER_TOKEN each + PER_ATTN per (query, context) pair (attention grows with the
    prefix); 10% more per decode beyond the first."""
    shape = step_shape(out)
    t = QUIET * (1 + 0.1 * max(shape.decodes - 1, 0))
    if shape.prompt_tokens:
        attn = sum(
            i.num_new_tokens * (i.start + i.num_new_tokens) for i in out.scheduled if i.num_new_tokens > 1
        )
        t += OVERHEAD + PER_TOKEN * shape.prompt_tokens + PER_ATTN * attn
    return t


def _req(rid: str, n: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(range(100, 100 + n)), params, eos_token_ids=frozenset({2}))


def _run(
    s: Scheduler, cap: AdaptivePrefillCap | None, steps: int
) -> list[tuple[SchedulerOutput, float, dict[str, int]]]:
    log = []
    for _ in range(steps):
        if not s.has_unfinished():
            break
        out = s.schedule()
        t = step_cost(out)
        if cap is not None:
            cap.observe(step_shape(out), t)
        first = {i.request.request_id: 1 for i in out.scheduled if i.sample}
        s.update_from_output(out, ModelOutput(sampled_token_ids={k: 7 for k in first}))
        log.append((out, t, {i.request.request_id: i.num_new_tokens for i in out.scheduled}))
    return log


@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_running_stream_step_stays_within_the_factor_during_a_long_prefill(factor: float) -> None:
    """Issue 49: one stream decoding while a 4,000-token prompt prefills. With the measured cap every
    step beside the stream costs at most ~factor x its quiet step (10% for the lag of a window that
    follows the growing context), the stream decodes every step and the prompt finishes; with the fixed
    128-token cap of before, those steps cost several times the quiet one."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=8192, long_prefill_token_threshold=128
    )
    cap = AdaptivePrefillCap(PrefillCapConfig(itl_factor=factor, initial=128, min_tokens=4, max_tokens=2048))
    results = {}
    for name, adaptive in (("fixed", None), ("measured", cap)):
        s = Scheduler(cfg, KVCacheManager(1024, 16, False), prefill_cap=adaptive)
        s.add_request(_req("stream", 8, max_tokens=5000))
        _run(s, adaptive, 12)  # its prefill, then quiet decode steps the cap measures
        s.add_request(_req("long", 4000, max_tokens=1))
        log = _run(s, adaptive, 2000)
        assert all(rows.get("stream") == 1 for _, _, rows in log)  # the stream every step
        done = [
            k
            for k, (out, _, _) in enumerate(log)
            if any(i.sample for i in out.scheduled if i.request.request_id == "long")
        ]
        assert done, "the long prompt finished its prefill"
        ratios = [t / QUIET for _, t, rows in log[: done[0] + 1] if rows.get("long", 0) > 1]
        results[name] = (ratios, done[0] + 1)
    ratios, steps = results["measured"]
    # the first mixed steps run at the initial cap while the costs are measured
    assert max(ratios[3:]) <= factor * 1.1, ratios
    assert max(results["fixed"][0]) > 3.5  # what the fixed cap gave
    # the trade-off: more steps for the long prompt (its TTFT), bounded by the floor
    assert results["fixed"][1] < steps <= 4000 // 4


def test_measured_cap_keeps_oldest_first_and_starves_nobody() -> None:
    """Two long prompts beside three streams under the measured cap: the older finishes its prefill first,
    the streams decode every step, both prompts finish."""
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096)
    cap = AdaptivePrefillCap(PrefillCapConfig(initial=64, min_tokens=8, max_tokens=512))
    s = Scheduler(cfg, KVCacheManager(1024, 16, False), prefill_cap=cap)
    for n in range(3):
        s.add_request(_req(f"d{n}", 8, max_tokens=3000))
    _run(s, cap, 10)
    s.add_request(_req("old", 1500, max_tokens=1))
    s.add_request(_req("new", 1500, max_tokens=1))
    order = []
    for out, _, rows in _run(s, cap, 3000):
        assert all(rows.get(f"d{n}") == 1 for n in range(3)), rows
        order += [
            i.request.request_id for i in out.scheduled if i.sample and i.request.request_id in ("old", "new")
        ]
        assert s.last_prefill_cap >= 8
        if len(order) == 2:
            break
    assert order == ["old", "new"]


def test_measured_cap_governs_long_prefills_only() -> None:
    """Issue 49, the default on CPU (`min_prompt_tokens`): a 4,000-token prompt's chunks beside a stream,
    its last one included, follow the measured cap (every such step within ~2x the quiet one), while a
    prompt of 200 tokens arriving during it, and one of 1,000 (not long), still get the fixed share; a
    burst's long prompt that ends its prefill in the step is admitted whole as before; nothing is left
    marked long."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=8192, long_prefill_token_threshold=128
    )
    factor = 2.0
    cap = AdaptivePrefillCap(
        PrefillCapConfig(
            itl_factor=factor, initial=128, min_tokens=4, max_tokens=2048, min_prompt_tokens=1024
        )
    )
    s = Scheduler(cfg, KVCacheManager(2048, 16, False), prefill_cap=cap)
    for rid in ("stream", "stream2"):  # two: one waiting prompt beside them is no burst
        s.add_request(_req(rid, 8, max_tokens=8000))
    _run(s, cap, 12)
    s.add_request(_req("long", 4000, max_tokens=1))
    log = _run(s, cap, 40)  # the cap measured and the long prompt well under way
    s.add_request(_req("short", 200, max_tokens=1))
    log += _run(s, cap, 3000 - len(log))
    assert all(rows.get("stream") == 1 and rows.get("stream2") == 1 for _, _, rows in log)
    long_steps = [(t, rows) for _, t, rows in log if rows.get("long", 0) > 1]
    assert long_steps[-1][1]["long"] < 128, "the last chunk too follows the measured cap"
    alone = [t / (QUIET * 1.1) for t, rows in long_steps[3:] if "short" not in rows]  # two decodes: 1.1x
    assert max(alone) <= factor * 1.1, alone
    short = [rows["short"] for _, _, rows in log if "short" in rows]
    assert short[0] > max(rows["long"] for _, rows in long_steps[3:]), (short, long_steps[3:])
    assert sum(short) == 200 and len(short) <= 3
    # the fixed share, less the long chunk in the same step (all but its last chunk, the rest)
    shared = [rows["short"] + rows.get("long", 0) for _, _, rows in log if "short" in rows]
    assert shared[:-1] == [128] * (len(shared) - 1), shared
    assert not s._long_prefills
    # a prompt of 1,000 uncached tokens is not long: the fixed 128-token share
    s.add_request(_req("mid", 1000, max_tokens=1))
    mid = [rows["mid"] for _, _, rows in _run(s, cap, 40) if rows.get("mid", 0) > 1]
    assert mid[:-1] == [128] * (len(mid) - 1) and sum(mid) == 1000
    # a burst (as many waiting as decoding): a long prompt that ends its prefill in the step is admitted whole
    for rid in ("burst", "burst2"):
        s.add_request(_req(rid, 1000 if rid == "burst2" else 1025, max_tokens=1))
    out = s.schedule()
    assert {i.request.request_id: i.num_new_tokens for i in out.scheduled}["burst"] == 1025
    assert not s._long_prefills


def test_long_prefill_mark_ends_with_preemption_and_abort() -> None:
    """A long prefill's mark (the measured share) goes when it is preempted or aborted, so a recompute is
    judged again and no id is left behind."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=256, max_num_seqs=8, max_model_len=8192, long_prefill_token_threshold=128
    )
    cap = AdaptivePrefillCap(
        PrefillCapConfig(initial=64, min_tokens=4, max_tokens=256, min_prompt_tokens=300)
    )
    s = Scheduler(cfg, KVCacheManager(512, 16, False), prefill_cap=cap)
    s.add_request(_req("stream", 8, max_tokens=8000))
    _run(s, cap, 3)
    for rid in ("a", "b"):
        s.add_request(_req(rid, 1000, max_tokens=1))
    log = _run(s, cap, 4)
    assert s._long_prefills == {"a"}  # "b" waits behind the older long prompt (first come, first served)
    assert all(rows.get("a", 64) <= 64 for _, _, rows in log)
    s.running.remove(s.requests["a"])
    s._preempt(s.requests["a"])
    assert not s._long_prefills
    _run(s, cap, 2)
    assert "a" in s._long_prefills
    s.finish_request("a", FinishReason.ABORT)
    assert "a" not in s._long_prefills
