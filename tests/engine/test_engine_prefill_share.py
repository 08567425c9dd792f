"""The engine hands its scheduler the prefill share cap for the device it runs on
(EngineConfig.long_prefill_threshold_for; the cap's behaviour: tests/core/test_core_scheduler.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from server.config import CPU_LONG_PREFILL_TOKEN_THRESHOLD, CacheConfig, EngineConfig, ModelConfig
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
