"""The server's own memory estimate at start (server/memory_estimate.py over the model it is about to
load, under its flags): logged, reported in /info, and checked against the memory cgroup's headroom so
that a container whose limit cannot hold the weights plus one full-length sequence fails fast with the
number needed instead of being OOM-killed halfway through loading. Plain Python (no torch)."""

from __future__ import annotations

import logging
from pathlib import Path

from server import cpu_env
from server.config import EngineConfig
from server.memory_estimate import (
    EstimateError,
    InsufficientMemoryError,
    MemoryEstimate,
    ServingSettings,
    estimate_memory,
    memory_verdict,
)

log = logging.getLogger(__name__)


def serving_estimate(
    config: EngineConfig,
    model: Path,
    compute_dtype: str,
    max_model_len: int,
    gguf_tiles: bool = False,
    gguf_q8_tiles: bool = True,
) -> MemoryEstimate | None:
    """The estimate for `model` (a folder, or the GGUF file served as it is) under `config`'s flags;
    `compute_dtype`: what --dtype resolved to here (float32, bfloat16, float16); `gguf_tiles`: this CPU
    will hold the GGUF's quantized tensors in 16-row tiles (ServingSettings.gguf_tiles; `gguf_q8_tiles`
    its Q8_0 too: gguf_checkpoint.q8_tiles_enabled). None (logged) when
    the files cannot be read for one: the server still starts."""
    cache = config.cache
    try:
        settings = ServingSettings(
            dtype=config.model.dtype if model.suffix == ".gguf" else compute_dtype,
            auto_dtype=compute_dtype,
            quantize=config.model.quantize,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            kv_cache_dtype=cache.cache_dtype,
            kv_cache_memory=cache.kv_cache_memory_bytes,
            block_size=cache.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            gguf_tiles=gguf_tiles,
            gguf_q8_tiles=gguf_q8_tiles,
        )
        return estimate_memory(model, settings)
    except (EstimateError, ValueError, OSError) as e:
        log.warning("no memory estimate for %s: %s", model, e)
        return None


def check_memory(estimate: MemoryEstimate | None, headroom: int | None = None) -> None:
    """Logs the estimate; raises InsufficientMemoryError when the cgroup's headroom (read here unless
    given) is below the weights plus one full-length sequence's KV, warns when below the whole KV cache."""
    if estimate is None:
        return
    log.info(
        "memory estimate: %.2f GiB (weights %.2f GiB, KV cache %.2f GiB: %d bytes a token over %d "
        "full-attention layers, %d windowed layers at their window, runtime %.2f GiB)",
        estimate.total_bytes / 2**30,
        estimate.weight_bytes / 2**30,
        estimate.kv_cache_bytes / 2**30,
        estimate.kv_bytes_per_token,
        estimate.num_layers - estimate.num_windowed_layers,
        estimate.num_windowed_layers,
        estimate.runtime_overhead_bytes / 2**30,
    )
    verdict = memory_verdict(estimate, cpu_env.cgroup_memory_headroom() if headroom is None else headroom)
    if verdict is None:
        return
    kind, message = verdict
    if kind == "error":
        raise InsufficientMemoryError(message)
    log.warning("%s", message)
