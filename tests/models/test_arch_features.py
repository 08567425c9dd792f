"""Engine features on the architectures beyond Llama (issue 44 item 4), per family on test_arch_parity.py's
tiny random models: speculative decoding (n-gram, and a draft model: the target itself, so every draft
is accepted) keeps greedy output token for token with plain decoding, and structured output (a regex)
constrains the text, through each family's layers (soft-capped attention, windows, fused checkpoint
tensors, multipliers, post-norms, NoPE layers), and LoRA on attention and MLP targets equals
peft (Phi-3's adapters target its fused qkv_proj / gate_up_proj)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from engine_driver import run_staggered
from test_arch_parity import MAX_LEN, build

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import GrammarSpec, SamplingParams
from server.spec_decode.config import SpeculativeConfig

TEXTS = [
    "one two three four one two three four one two",
    "The cat sat on the mat. The cat sat on the",
    "a b c d e f a b c",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# gemma2 (soft-capped attention, interleaved windows) in every run; the other families under -m slow
# (~10 s each on a shared 2-core machine)
KINDS = [
    ("gemma2", True),
    *(
        pytest.param(k, t, marks=pytest.mark.slow)
        for k, t in [
            ("phi3", False),
            ("gemma3", True),
            ("granite", False),
            ("olmo2", False),
            ("smollm3", True),
        ]
    ),
]


def _engine(folder: Path, spec: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=256, enable_prefix_caching=True),
            max_num_batched_tokens=16,
            speculative=spec,
        )
    )


@pytest.mark.parametrize(("kind", "tie"), KINDS)
def test_speculation_keeps_greedy_output(kind: str, tie: bool, tmp_path: Path, smollm2_dir: Path) -> None:
    folder = build(tmp_path / kind, smollm2_dir, kind, tie)
    base = _engine(folder)
    prompts = [base.tokenizer.encode(t) for t in TEXTS]
    ref = run_staggered(base, prompts, GREEDY)
    ngram = _engine(folder, SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert run_staggered(ngram, prompts, GREEDY) == ref
    draft = _engine(folder, SpeculativeConfig("draft_model", 3, model=str(folder)))
    assert run_staggered(draft, prompts, GREEDY) == ref
    for e in (ngram, draft):
        stats = e.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    # structured output: the grammar holds on the random model's text (a bounded one: it ends)
    pattern = r"(red|green|blue) [0-9]{2}"
    params = SamplingParams(max_tokens=24, temperature=0.0, structured=GrammarSpec("regex", pattern))
    text = base.tokenizer.decode(base.generate([prompts[0]], params)[0])
    assert re.fullmatch(pattern, text), text


LORA_CASES = [
    # Phi-3: peft targets its fused checkpoint modules; their lora_B rows split into q/k/v and gate/up
    ("phi3", False, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    pytest.param(
        "gemma2",
        True,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("kind", "tie", "targets"), LORA_CASES)
def test_lora_on_attention_and_mlp_matches_peft(
    kind: str, tie: bool, targets: tuple[str, ...], tmp_path: Path, smollm2_dir: Path
) -> None:
    from lora_adapters import make_adapter, peft_greedy

    from server.config import LoRAConfig, LoRAModule

    folder = build(tmp_path / kind, smollm2_dir, kind, tie)
    adapter = make_adapter(folder, tmp_path / "adapter", 8, targets, seed=1, std=0.15)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=128),
            lora=LoRAConfig(
                enable_lora=True, lora_modules=(LoRAModule("a", str(adapter)),), max_loras=1, max_lora_rank=8
            ),
        )
    )
    assert engine.lora is not None
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = peft_greedy(folder, adapter, prompts, 12)
    assert ref != peft_greedy(folder, None, prompts, 12)  # the adapter changes the output
    assert engine.generate(prompts, params, [engine.lora.get("a")] * len(prompts)) == ref
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
