"""Greedy parity with transformers' generate, token for token, through the paged engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "List three colours:",
    "Water boils at",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: good morning",
    "A short poem about autumn leaves, falling slowly from the old oak tree in the garden behind the house:",
]
NEW_TOKENS = 24


def hf_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.generation_config.eos_token_id = hf.config.eos_token_id
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=0)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def make_engine(folder: Path, **kw: object) -> LLMEngine:
    cache = kw.pop("cache", CacheConfig())
    return LLMEngine(
        EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"), cache=cache, **kw)  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> tuple[LLMEngine, list[list[int]], list[list[int]]]:
    engine = make_engine(smollm2_dir)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(smollm2_dir, prompts, NEW_TOKENS)
    return engine, prompts, ref


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.slow
def test_smollm2_greedy_parity_staggered(smol: tuple[LLMEngine, list[list[int]], list[list[int]]]) -> None:
    engine, prompts, ref = smol
    assert engine.backend_name == "cpu"  # auto on CPU: the compiled decode kernel
    assert len({len(p) for p in prompts}) == len(prompts)  # all different lengths
    assert run_staggered(engine, prompts, GREEDY) == ref
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.slow
def test_smollm2_parity_under_preemption_and_chunked_prefill(
    smollm2_dir: Path, smol: tuple[LLMEngine, list[list[int]], list[list[int]]]
) -> None:
    _, prompts, ref = smol
    # 14 blocks of 8 tokens cannot hold 8 sequences of ~40 tokens, and a 16-token budget chunks every prompt.
    engine = make_engine(
        smollm2_dir,
        cache=CacheConfig(block_size=8, num_kv_blocks=14, enable_prefix_caching=False),
        max_num_batched_tokens=16,
    )
    assert run_staggered(engine, prompts, GREEDY) == ref
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow
def test_smollm2_prefix_caching_same_output_less_compute(smollm2_dir: Path) -> None:
    system = "You are a helpful assistant. Answer briefly and precisely, in one sentence. Question: "
    shared = [system + q for q in ("Why is the sky blue?", "What is rain?")]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    off = make_engine(smollm2_dir, cache=CacheConfig(enable_prefix_caching=False))
    on = make_engine(smollm2_dir, cache=CacheConfig(enable_prefix_caching=True))
    ids = [off.tokenizer.encode(s) for s in shared]
    # sequentially, so the second request finds the first one's blocks
    out_off = [off.generate([p], params)[0] for p in ids]
    out_on = [on.generate([p], params)[0] for p in ids]
    assert out_on == out_off
    assert on.stats().num_prompt_tokens < off.stats().num_prompt_tokens
    assert on.stats().prefix_cache_hits >= 16
    assert on.stats().num_free_blocks == on.stats().num_total_blocks


# "cpu" (the compiled decode kernel) is what auto picks on CPU and serves the SmolLM2 tests above;
# "torch" is the fallback when no compiler is found.
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_parity(tiny_model_factory, arch: str, tie: bool, backend: str) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory(arch, tie=tie, heads=4, kv_heads=2)
    import json

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    engine = make_engine(folder, cache=CacheConfig(block_size=8, num_kv_blocks=64), attention_backend=backend)
    assert engine.backend_name == backend
    a = engine.loaded.arch
    assert a.num_heads != a.num_kv_heads
    # Qwen2: q/k/v bias; Qwen3: no bias, per-head q/k RMSNorm, head_dim 32 (q is 128 wide, hidden 64)
    assert (a.qkv_bias, a.qk_norm) == ((True, False) if arch == "qwen2" else (False, True))
    if arch == "qwen3":
        assert a.num_heads * a.head_dim != a.hidden_size
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(folder, prompts, 16)
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=16, temperature=0.0)) == ref


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_preemption_parity(tiny_model_factory, arch: str, backend: str) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory(arch, tie=False)
    engine = make_engine(
        folder,
        cache=CacheConfig(block_size=4, num_kv_blocks=20),
        max_num_batched_tokens=8,
        attention_backend=backend,
    )
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(folder, prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert run_staggered(engine, prompts, params) == ref
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_free_blocks == 20


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_prefix_caching_parity(tiny_model_factory, arch: str) -> None:  # type: ignore[no-untyped-def]
    """Prompts sharing a block-aligned prefix, one after the other: the later ones reuse the first one's
    cached K/V (for Qwen3: keys stored after k_norm and RoPE) and still equal transformers' tokens."""
    folder = tiny_model_factory(arch, tie=True)
    engine = make_engine(
        folder, cache=CacheConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    )
    system = "You are a helpful assistant. Answer briefly and precisely, in one sentence. Question: "
    prompts = [engine.tokenizer.encode(system + q) for q in ("Why is the sky blue?", "What is rain?", "Hi")]
    ref = hf_greedy(folder, prompts, 10)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    assert [engine.generate([p], params)[0] for p in prompts] == ref
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 2 * 16 and stats.num_free_blocks == stats.num_total_blocks
