"""Every dense layer kind through a bf16 model's fused stream (LlamaForCausalLM._forward_fused over bf16,
ArchConfig.fused_cpu_bf16): the tiny random model of each family (test_arch_parity.py) in bf16 against our
fp32 path, the fused ops on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prompt_logprobs import engine_prompt_logprobs
from test_arch_parity import MAX_LEN, build

from server.config import EngineConfig, ModelConfig
from server.engine import LLMEngine


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "granite", "olmo2", "phi3", "smollm3"])
def test_every_dense_layer_kind_through_the_fused_bf16_stream(
    kind: str, tmp_path: Path, smollm2_dir: Path
) -> None:
    """Sandwich norms and soft-caps (Gemma 2/3), a residual multiplier (Granite), post-norms over the whole
    projection's q/k (OLMo 2), partial rotary (Phi-3), NoPE layers (SmolLM3): the tiny random model of each
    family in bf16, prompt logprobs against our fp32 path (transformers' own, tests/models/test_arch_parity.py):
    the fused stream's mean error within 1.25x of torch's bf16 ops' (plus 2e-3 nats: random weights put
    both near zero)."""
    folder = build(tmp_path / kind, smollm2_dir, kind, tie=kind.startswith("gemma"))

    def run(dtype: str, fused: bool) -> torch.Tensor:
        engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(folder), dtype=dtype, max_model_len=MAX_LEN),
                max_num_batched_tokens=32,
            )
        )
        model = engine.loaded.model
        assert model.fused_ops is not None and (dtype == "float32" or model.config.fused_cpu_bf16)
        if not fused:
            model.fused_ops = None
        return engine_prompt_logprobs(engine, prompt)

    prompt = [3 + (i * 37) % 250 for i in range(96)]
    ref = run("float32", True)
    fused, plain = (run("bfloat16", True) - ref).abs(), (run("bfloat16", False) - ref).abs()
    assert float(fused.mean()) <= 1.25 * float(plain.mean()) + 2e-3, (
        float(fused.mean()),
        float(plain.mean()),
    )
