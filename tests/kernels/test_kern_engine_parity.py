"""The engine on the Triton attention backend gives the same greedy tokens as on the torch backend.

On CPU the kernels run under the interpreter (conftest): slow, so the model is tiny (2 layers, hidden
64, 4 heads, 2 KV heads) and the prompts are few. Small blocks and a small token budget make the steps
mix decode rows, chunked prefills over cached prefixes and fresh prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from engine_driver import run_staggered

import server.attention.triton_backend as triton_attention
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The capital of France is a city",  # shares a block-aligned prefix with the first (prefix-cache hit)
]
NEW_TOKENS = 8


def _engine(folder: Path, backend: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=True),
            max_num_batched_tokens=12,
            attention_backend=backend,
        )
    )


@pytest.mark.slow
def test_triton_backend_greedy_tokens_equal_torch_backend(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"decode": 0, "prefill": 0}

    def counted(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        triton_attention, "paged_attention_decode", counted("decode", triton_attention.paged_attention_decode)
    )
    monkeypatch.setattr(
        triton_attention,
        "paged_prefill_attention",
        counted("prefill", triton_attention.paged_prefill_attention),
    )

    folder = tiny_model_factory("llama", tie=True, layers=2, hidden=64, heads=4, kv_heads=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(folder, backend)
        assert engine.backend_name == backend
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        results[backend] = run_staggered(engine, prompts, params)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.prefix_cache_hits > 0
    assert all(len(tokens) == NEW_TOKENS for tokens in results["torch"])
    # Both kernels ran (pure-decode steps and prefill/mixed steps), on every layer.
    assert calls["decode"] > 0 and calls["prefill"] > 0
    assert results["triton"] == results["torch"]
