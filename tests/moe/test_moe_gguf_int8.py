"""`--quantize int8` on a mixture-of-experts GGUF (server/models/loader.py convert_gguf): the file is read
by our GGUF reader, dequantized to fp32 safetensors with each MoE layer under SparseMoeBlock's names,
and that folder is quantized as an HF folder is (`quantize_moe_blocks`: every expert int8 per output
channel, the shared expert's projections too; routers and the shared expert's gate kept). Accuracy: prompt logprobs within the int8 MoE bound of
tests/moe/test_moe_quantize.py against the same weights unquantized (transformers' layout of the
file's dequantized weights, served by us in fp32). Mixtral (`llama` layout: q/k rows permuted) and
Qwen2-MoE (shared expert, a dense layer). Slow: each file's SmolLM2 tokenizer is converted from its
GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_gguf import save_dequantized, write_moe_gguf
from moe_models import PROMPTS, build, moe_engine
from prompt_logprobs import engine_prompt_logprobs
from test_moe_quantize import MAX_NATS, PPL_RATIO

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.moe import BlockQuantExperts, SparseMoeBlock
from server.quant.block_linear import BlockQuantLinear

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_gguf_quantize_int8_within_the_int8_moe_bound(
    tmp_path: Path, smollm2_dir: Path, kind: str
) -> None:
    hf = build(tmp_path / "hf", smollm2_dir, kind)
    path, weights = write_moe_gguf(hf, tmp_path / f"{kind}.gguf", "Q8_0")
    ref = moe_engine(save_dequantized(hf, tmp_path / "dequantized", weights))
    q = LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=str(path), dtype="float32", max_model_len=256, quantize="int8", cache_dir=tmp_path / "c"
            ),
            cache=CacheConfig(block_size=4, num_kv_blocks=128),
            max_num_batched_tokens=8,
        )
    )
    assert q.loaded.quantization == "int8"
    blocks = [m for m in q.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == {"mixtral": 4, "qwen2_moe": 3}[kind]
    for b in blocks:
        assert isinstance(b.experts, BlockQuantExperts) and b.w13 is None and b.w2 is None
        assert {w.fmt for w in b.experts.w13 + b.experts.w2} == {"int8"}
        # Qwen2-MoE's shared expert is quantized as every dense projection is (its sigmoid gate kept)
        assert b.shared_w13 is None and b.shared_w2 is None
        assert (b.shared_gate is not None) == (kind == "qwen2_moe")
        if kind == "qwen2_moe":
            shared = [b.shared_gate_up, b.shared_down]
            assert all(isinstance(m, BlockQuantLinear) and m.weight_q.fmt == "int8" for m in shared)
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    assert [q.tokenizer.encode(p) for p in PROMPTS] == prompts
    ours = torch.cat([engine_prompt_logprobs(q, p) for p in prompts])
    theirs = torch.cat([engine_prompt_logprobs(ref, p) for p in prompts])
    diff = (ours - theirs).abs()
    assert 1e-4 < diff.max().item() < MAX_NATS, diff.max()  # quantized, and close
    ratio = torch.exp((theirs - ours).mean()).item()  # perplexity int8 / unquantized
    assert 1 / PPL_RATIO < ratio < PPL_RATIO, ratio
    assert q.stats().num_free_blocks == q.stats().num_total_blocks
