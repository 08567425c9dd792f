"""The int8 batched path's packed weight copies (gemm_dtype.pack_int8_weights) are made at load only where
they leave the KV cache, allocated after them, its room: a pod whose memory limit was sized from the
estimate (weights + KV cache + runtime) must not spend it on copies and be OOM-killed once the cache
fills. /info reports the copies' bytes (`packed_weight_bytes`)."""

from __future__ import annotations

import pytest

from server import cpu_env
from server.config import EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.quant import cpu_qgemv_q8 as q8
from server.quant.gemm_dtype import packed_copies_fit


def test_packed_copies_leave_the_reserve_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(q8.PACK_ENABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_env, "available_memory_bytes", lambda: 1000)
    assert packed_copies_fit(200, None, "test", reserve_bytes=800)  # 200 of 1,000 and 800 left
    assert not packed_copies_fit(200, None, "test", reserve_bytes=801)
    assert not packed_copies_fit(300, None, "test")  # over the share (25%) with nothing reserved
    assert packed_copies_fit(200, True, "test", reserve_bytes=10**6)  # KUBEINFER_INT8_PACK=1: always


def test_the_engine_packs_only_beside_its_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model (Q4_1 + Q8_0 GGUF, bf16 or int8 GEMMs): with its copies' bytes plus the KV
    allocation available the engine packs (and /info's figure is their size); with a byte less it does
    not, though the copies alone are well within the share of memory that was the only rule before."""
    monkeypatch.setenv(q8.PACK_ENABLE_ENV, "1")
    forced = LLMEngine(EngineConfig(model=ModelConfig()))
    need = forced.info.packed_weight_bytes
    if need == 0:
        pytest.skip("no packed copies here (the batched int8 path runs on AVX512-VNNI only)")
    assert forced.memory is not None
    kv = forced.memory.kv_cache_bytes
    assert kv > 0 and need < 0.25 * (need + kv)
    monkeypatch.delenv(q8.PACK_ENABLE_ENV)
    monkeypatch.setattr(cpu_env, "available_memory_bytes", lambda: need + kv)
    assert LLMEngine(EngineConfig(model=ModelConfig())).info.packed_weight_bytes == need
    monkeypatch.setattr(cpu_env, "available_memory_bytes", lambda: need + kv - 1)
    assert LLMEngine(EngineConfig(model=ModelConfig())).info.packed_weight_bytes == 0
