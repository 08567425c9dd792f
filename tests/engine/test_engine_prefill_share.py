"""The engine hands its scheduler the prefill share cap for the device it runs on
(EngineConfig.long_prefill_threshold_for; the cap's behaviour: tests/core/test_core_scheduler.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from server.config import (
    CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    CPU_PREFILL_ITL_FACTOR,
    CacheConfig,
    EngineConfig,
    ModelConfig,
)
from server.engine import LLMEngine
from server.request import SamplingParams


@pytest.mark.parametrize(("configured", "want"), [(None, CPU_LONG_PREFILL_TOKEN_THRESHOLD), (0, 0), (48, 48)])
def test_engine_prefill_share_cap_on_cpu(
    tiny_model_factory: Callable[..., Path], configured: int | None, want: int
) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_model_factory()), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=64),
            device="cpu",
            long_prefill_token_threshold=configured,
        )
    )
    assert engine.scheduler.config.long_prefill_token_threshold == want
    # Beside two running decodes a long prompt's first step takes at most the cap (all of it: no cap).
    # (Two: one waiting prompt beside one decode would be a burst, admitted whole.)
    for rid in ("a", "a2"):
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.add_request("b", list(range(10, 210)), SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()
    assert engine.scheduler._last_batched_tokens == 2 + (want or 200)


def test_engine_sizes_the_cap_from_its_own_step_costs(tiny_model_factory: Callable[..., Path]) -> None:
    """Issue 49: with --prefill-itl-factor and --prefill-itl-min-tokens 0 the engine measures its steps
    (core/prefill_cap.py) and each step beside decodes takes at most the cap it then computes, from the
    fixed value on until both costs are measured; with the factor off the fixed cap holds, and setting
    both, or a factor in (0, 1], is refused."""
    model = ModelConfig(model=str(tiny_model_factory()), dtype="float32")
    engine = LLMEngine(
        EngineConfig(
            model=model,
            cache=CacheConfig(num_kv_blocks=128),
            device="cpu",
            prefill_itl_factor=2.0,
            prefill_itl_min_tokens=0,
        )
    )
    cap = engine.scheduler.prefill_cap
    assert cap is not None and cap.config.itl_factor == 2.0 and cap.config.max_tokens == 2048
    for rid in ("a", "a2"):  # two streams: one waiting prompt beside them is no burst
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    engine.add_request("b", list(range(10, 510)), SamplingParams(max_tokens=1, temperature=0.0))
    caps = []
    while "b" in engine.scheduler.requests:
        engine.step()
        caps.append(engine.scheduler.last_prefill_cap)
        assert engine.scheduler._last_batched_tokens <= 2 + caps[-1]  # the two decodes + the cap
    assert caps[0] == CPU_LONG_PREFILL_TOKEN_THRESHOLD  # nothing measured beside decodes yet
    assert cap.quiet_seconds(1) is not None and cap.prompt_cost() is not None
    assert len(set(caps)) > 1  # sized from what the steps cost
    fixed = LLMEngine(
        EngineConfig(model=model, cache=CacheConfig(num_kv_blocks=64), device="cpu", prefill_itl_factor=0)
    )
    assert fixed.scheduler.prefill_cap is None
    assert EngineConfig(prefill_itl_factor=3.0).prefill_cap_for("cuda") is not None
    assert EngineConfig().prefill_cap_for("cuda") is None
    with pytest.raises(ValueError, match="set one of them"):
        EngineConfig(prefill_itl_factor=2.0, prefill_itl_min_tokens=0, long_prefill_token_threshold=64)
    # long prefills only (the default's kind): the fixed threshold set beside it is fine
    both = EngineConfig(prefill_itl_factor=2.0, long_prefill_token_threshold=64).prefill_cap_for("cpu")
    assert both is not None and both.min_prompt_tokens == 2048  # the token budget
    with pytest.raises(ValueError, match="prefill_itl_min_tokens"):
        EngineConfig(prefill_itl_min_tokens=-1)
    for bad in (1.0, 0.5, -1.0, float("nan")):
        with pytest.raises(ValueError, match="prefill_itl_factor"):
            EngineConfig(prefill_itl_factor=bad)


def test_engine_default_caps_long_prefills_on_cpu(tiny_model_factory: Callable[..., Path]) -> None:
    """Issue 49's 8k-prompt ITL by default on CPU: the measured cap (factor CPU_PREFILL_ITL_FACTOR) sizes
    the chunks of a prompt longer than the token budget beside decodes, every one of them; a shorter
    prompt keeps the fixed 128-token share. Off on CUDA. (The tiny model's context is 1,024 tokens, so
    the engine runs with a smaller prefill_itl_min_tokens.)"""
    model = ModelConfig(model=str(tiny_model_factory()), dtype="float32")
    default = EngineConfig(model=model).prefill_cap_for("cpu")
    assert default is not None and default.itl_factor == CPU_PREFILL_ITL_FACTOR
    assert default.min_prompt_tokens == EngineConfig().max_num_batched_tokens
    assert EngineConfig().prefill_cap_for("cuda") is None
    min_tokens = 400
    engine = LLMEngine(
        EngineConfig(
            model=model, cache=CacheConfig(num_kv_blocks=256), device="cpu", prefill_itl_min_tokens=min_tokens
        )
    )
    for rid in ("a", "a2"):  # two streams: one waiting prompt beside them is no burst
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    chunks: dict[str, list[tuple[int, int]]] = {}
    for rid, n, base in (("mid", min_tokens, 10), ("long", min_tokens + 300, 300)):  # no common prefix
        engine.add_request(
            rid, [base + i % 200 for i in range(n)], SamplingParams(max_tokens=1, temperature=0.0)
        )
        while rid in engine.scheduler.requests:
            before = engine.scheduler.requests[rid].num_computed_tokens
            engine.step()
            req = engine.scheduler.requests.get(rid)
            done = req.num_computed_tokens if req is not None else n
            chunks.setdefault(rid, []).append((done - before, engine.scheduler.last_long_prefill_cap))
    assert [c for c, _ in chunks["mid"]][:-1] == [CPU_LONG_PREFILL_TOKEN_THRESHOLD] * (len(chunks["mid"]) - 1)
    assert all(0 < c <= cap <= CPU_LONG_PREFILL_TOKEN_THRESHOLD for c, cap in chunks["long"]), chunks
    assert not engine.scheduler._long_prefills


def test_engine_threshold_zero_and_an_idle_min_tokens(
    tiny_model_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """--long-prefill-token-threshold 0 ("no cap beyond the budget") turns the device's measured cap off
    too; --prefill-itl-min-tokens where no measured cap runs (here: chunked prefill off) is logged as doing
    nothing rather than ignored in silence."""
    model = ModelConfig(model=str(tiny_model_factory()), dtype="float32")
    cache = CacheConfig(num_kv_blocks=64)
    uncapped = LLMEngine(EngineConfig(model=model, cache=cache, device="cpu", long_prefill_token_threshold=0))
    assert (
        uncapped.scheduler.prefill_cap is None and uncapped.scheduler.config.long_prefill_token_threshold == 0
    )
    with caplog.at_level("WARNING", logger="server.engine"):
        idle = LLMEngine(
            EngineConfig(
                model=model,
                cache=cache,
                device="cpu",
                enable_chunked_prefill=False,
                max_num_batched_tokens=1024,
                prefill_itl_min_tokens=512,
            )
        )
    assert idle.scheduler.prefill_cap is None
    assert any("--prefill-itl-min-tokens has no effect" in r.getMessage() for r in caplog.records)
