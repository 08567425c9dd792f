"""The server's start-up memory check (server/memory_report.py): a memory cgroup whose headroom cannot
hold the weights plus one full-length sequence's KV fails before any weight is read, naming the bytes
needed; one below the whole KV cache warns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from server import cpu_env
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.memory_estimate import (
    InsufficientMemoryError,
    MemoryEstimate,
    ServingSettings,
    estimate_memory,
    memory_verdict,
)


def _config(model: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20),
        max_num_seqs=4,
        num_threads=1,
    )


def test_start_fails_fast_below_weights_plus_one_sequence(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.engine import LLMEngine

    model = tiny_model_factory("llama")
    est = estimate_memory(model, ServingSettings(dtype="float32", max_model_len=512, max_num_seqs=4))
    need = est.weight_bytes + est.kv_bytes_per_sequence
    monkeypatch.setattr(cpu_env, "cgroup_memory_headroom", lambda *a, **k: need - 1)
    loads: list[Path] = []
    import server.engine as engine_mod

    real_load = engine_mod.load_model

    def spy(*args: Any, **kwargs: Any) -> Any:
        loads.append(Path(str(args[0])))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "load_model", spy)
    with pytest.raises(InsufficientMemoryError, match=rf"\({need} bytes"):
        LLMEngine(_config(model))
    assert loads == []  # failed before reading a weight


def test_verdicts() -> None:
    est = estimate_memory_stub()
    assert memory_verdict(est, None) is None
    low = est.weight_bytes + est.kv_bytes_per_sequence
    error = memory_verdict(est, low - 1)
    assert error is not None and error[0] == "error"
    warn = memory_verdict(est, low)
    assert warn is not None and warn[0] == "warning" and "--kv-cache-memory" in warn[1]
    assert memory_verdict(est, est.weight_bytes + est.kv_cache_bytes) is None


def estimate_memory_stub() -> MemoryEstimate:
    return MemoryEstimate(
        source="safetensors", weight_bytes=1000, file_weight_bytes=1000, num_layers=2, num_windowed_layers=0,
        max_model_len=10, max_num_seqs=2, kv_dtype="float32", kv_bytes_per_token=8,
        kv_window_bytes_per_sequence=0, kv_bytes_per_sequence=80, kv_bytes_for_context=160,
        kv_cache_bytes=500, runtime_overhead_bytes=100, total_bytes=1600, minimum_bytes=1180,
    )  # fmt: skip


def test_warning_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    from server.memory_report import check_memory

    est = estimate_memory_stub()
    with caplog.at_level(logging.INFO, logger="server.memory_report"):
        check_memory(est, headroom=est.weight_bytes + est.kv_bytes_per_sequence)
    assert any("memory estimate" in r.message for r in caplog.records)
    assert any(r.levelno == logging.WARNING and "KV cache allocation" in r.message for r in caplog.records)


@pytest.mark.parametrize("kind", ["Q5_K", "Q4_K"])
def test_gguf_estimate_counts_the_layout_this_cpu_holds(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, kind: str
) -> None:
    """The server's own estimate of a GGUF served as it is counts the layout its loader then holds here:
    16-row tiles where this CPU holds them (a Q5_K file at 5.625 bits per weight, not the repack's 10.0,
    which a memory limit sized for the file would have failed at start), the repacks elsewhere: the
    estimate is the bytes the loaded model reports, within 1% of its quantized tensors'."""
    import torch
    from quant.gguf_models import random_block_model, write_tiny_gguf

    from server.engine import LLMEngine
    from server.quant.gguf_checkpoint import super_blocks_enabled

    template = tiny_model_factory("llama", tie=False, hidden=256)
    raw = random_block_model(template, tmp_path / "hf", {"*": kind, "model.embed_tokens.weight": "F32"})
    path = write_tiny_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", "F32", raw=raw)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), cache_dir=tmp_path / "cache", max_model_len=512),
            cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20),
            max_num_seqs=4,
        )
    )
    from server.quant.block_linear import BlockQuantLinear

    assert engine.memory is not None and engine.memory.source == "gguf"
    held = engine.info.weight_bytes
    quantized = sum(
        m.weight_q.nbytes() for m in engine.loaded.model.modules() if isinstance(m, BlockQuantLinear)
    )
    # the F32 embedding and norms count alike; the quantized tensors' bytes within 1% of what is held
    assert abs(engine.memory.weight_bytes - held) <= 0.01 * quantized, (
        engine.memory.weight_bytes,
        held,
        quantized,
    )
    tiles = super_blocks_enabled(engine.gemm_dtype)
    projections = engine.loaded.model.model.layers[0].mlp.down_proj.weight_q  # type: ignore[union-attr]
    assert projections.fmt == (f"{kind.lower()}_x16" if tiles else kind.lower())
    assert engine.gemm_dtype in (torch.float32, torch.bfloat16)
