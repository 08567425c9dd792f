"""LoRA serving in the engine: greedy parity with transformers + peft, alone and in mixed batches,
and prefix-cache isolation between adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_adapters import make_adapter, peft_greedy

from server.config import CacheConfig, EngineConfig, LoRAConfig, LoRAModule, ModelConfig
from server.engine import LLMEngine
from server.request import LoRARequest, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "List three colours:",
    "Water boils at",
    "Translate to French: good morning",
]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (name, rank, target modules, rsLoRA)
ADAPTERS = [
    ("all-r8", 8, ALL, False),
    ("attn-r4-rs", 4, ("q_proj", "v_proj"), True),
    ("mlp-r16", 16, ("gate_proj", "down_proj", "o_proj", "k_proj"), False),
]
NEW = 12


def lora_engine(folder: Path, adapters: dict[str, Path], max_loras: int, **kw: object) -> LLMEngine:
    lora = LoRAConfig(
        enable_lora=True,
        lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()),
        max_loras=max_loras,
        max_lora_rank=16,
    )
    cache = kw.pop("cache", CacheConfig(block_size=8, num_kv_blocks=128))
    return LLMEngine(
        EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"), cache=cache, lora=lora, **kw)  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def tiny_setup(tiny_model_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("qwen2", tie=False, heads=4, kv_heads=2)
    root = tmp_path_factory.mktemp("adapters")
    paths = {
        name: make_adapter(folder, root / name, rank, targets, seed=i + 1, std=0.15, rslora=rs)
        for i, (name, rank, targets, rs) in enumerate(ADAPTERS)
    }
    engine = lora_engine(folder, paths, max_loras=2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = {name: peft_greedy(folder, path, prompts, NEW) for name, path in paths.items()}
    ref["base"] = peft_greedy(folder, None, prompts, NEW)
    return folder, paths, engine, prompts, ref


def _lora(engine: LLMEngine, name: str) -> LoRARequest | None:
    assert engine.lora is not None
    return None if name == "base" else engine.lora.get(name)


def test_adapters_change_the_output(tiny_setup) -> None:  # type: ignore[no-untyped-def]
    _, _, _, _, ref = tiny_setup
    # the test is only meaningful if every adapter moves the greedy output away from the base model
    for name, _, _, _ in ADAPTERS:
        assert ref[name] != ref["base"], name


@pytest.mark.parametrize("name", [a[0] for a in ADAPTERS] + ["base"])
def test_single_adapter_parity(tiny_setup, name: str) -> None:  # type: ignore[no-untyped-def]
    _, _, engine, prompts, ref = tiny_setup
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    lora = _lora(engine, name)
    got = engine.generate(prompts, params, [lora] * len(prompts))
    assert got == ref[name]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_mixed_batch_parity_staggered(tiny_setup) -> None:  # type: ignore[no-untyped-def]
    """Rows of three adapters and the base model share steps (prefills and decodes mixed); with
    max_loras=2 the third adapter's requests wait for a slot rather than fail."""
    _, _, engine, prompts, ref = tiny_setup
    names = ["all-r8", "base", "attn-r4-rs", "mlp-r16", "base", "all-r8", "mlp-r16", "attn-r4-rs"]
    jobs = [(names[i], prompts[i % len(prompts)]) for i in range(len(names))]
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(jobs))
    max_running_loras = 0
    while pending or engine.has_unfinished():
        if pending:
            i, (name, prompt) = pending.pop(0)
            engine.add_request(f"m{i}", prompt, params, _lora(engine, name))
            got[f"m{i}"] = []
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        max_running_loras = max(max_running_loras, len(engine.stats().running_lora_adapters))
    for i, (name, _) in enumerate(jobs):
        assert got[f"m{i}"] == ref[name][i % len(prompts)], (i, name)
    assert max_running_loras == 2
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_prefix_cache_isolated_per_adapter(tiny_setup) -> None:  # type: ignore[no-untyped-def]
    """The same long prompt under the base model, then two adapters, then again: each gets its own
    output, and the repeated run hits its own adapter's cached blocks only."""
    _, _, engine, prompts, ref = tiny_setup
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    prompt = prompts[1]  # the longest: more than one full block of 8
    assert len(prompt) > 8
    for name in ["base", "all-r8", "attn-r4-rs", "base", "all-r8", "attn-r4-rs"]:
        hits = engine.stats().prefix_cache_hits
        out = engine.generate([prompt], params, [_lora(engine, name)])[0]
        assert out == ref[name][1], name
    assert engine.stats().prefix_cache_hits > hits  # the repeats were served from cached blocks
    # sequences under different adapters never share a hash chain
    lora = _lora(engine, "all-r8")
    assert lora is not None
    from server.core.block_pool import hash_block_tokens

    assert hash_block_tokens(lora.cache_key, prompt[:8]) != hash_block_tokens(None, prompt[:8])


def test_prefix_cache_hits_only_same_adapter(tiny_setup) -> None:  # type: ignore[no-untyped-def]
    _, _, engine, prompts, _ = tiny_setup
    params = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = list(reversed(prompts[1] + prompts[3]))  # a prompt no earlier test used
    hits = engine.stats().prefix_cache_hits
    engine.generate([prompt], params, [_lora(engine, "mlp-r16")])
    assert engine.stats().prefix_cache_hits == hits  # first time: nothing cached
    engine.generate([prompt], params, [_lora(engine, "attn-r4-rs")])
    assert engine.stats().prefix_cache_hits == hits  # another adapter: no reuse
    engine.generate([prompt], params, [None])
    assert engine.stats().prefix_cache_hits == hits  # base model: no reuse
    engine.generate([prompt], params, [_lora(engine, "mlp-r16")])
    assert engine.stats().prefix_cache_hits > hits  # same adapter again: its own blocks


@pytest.mark.slow
def test_smollm2_mixed_adapters_parity(smollm2_dir: Path, tmp_path: Path) -> None:
    """The embedded model (fused q/k/v and gate/up, pre-packed weights) with two adapters and base rows."""
    a = make_adapter(smollm2_dir, tmp_path / "a", 8, ALL, seed=11, std=0.03)
    b = make_adapter(
        smollm2_dir, tmp_path / "b", 16, ("q_proj", "k_proj", "up_proj"), seed=12, std=0.03, rslora=True
    )
    engine = lora_engine(smollm2_dir, {"a": a, "b": b}, max_loras=2, cache=CacheConfig())
    assert engine.loaded.model.model.layers[0].self_attn.qkv_proj is not None  # fused projections kept
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    ref = {"a": peft_greedy(smollm2_dir, a, prompts, NEW), "b": peft_greedy(smollm2_dir, b, prompts, NEW)}
    ref["base"] = peft_greedy(smollm2_dir, None, prompts, NEW)
    assert ref["a"] != ref["base"] and ref["b"] != ref["base"]
    names = ["a", "b", "base", "a", "b", "base", "b", "a"]
    loras = [_lora(engine, n) for n in names]
    got = engine.generate(
        [prompts[i % 4] for i in range(len(names))], SamplingParams(max_tokens=NEW, temperature=0.0), loras
    )
    assert got == [ref[n][i % 4] for i, n in enumerate(names)]
