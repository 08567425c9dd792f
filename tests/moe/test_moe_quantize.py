"""`--quantize int8` for mixture-of-experts models (server/models/moe/quant.py quantize_moe_blocks): each
expert's w13 and w2 quantized per output channel on its own (the dense projections' int8, through
qlinear's CPU kernel), Qwen2-MoE's shared expert's projections int8 as every dense projection, the router
and the shared expert's sigmoid gate kept in the model's dtype. Accuracy:
a tiny random Mixtral and Qwen2-MoE's prompt logprobs against the same model unquantized, within the
dense int8 bound (perplexity ratio 1.02, tests/quant/test_quant_accuracy.py); what the experts do not
take is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_models import PROMPTS, build, moe_engine
from prompt_logprobs import engine_prompt_logprobs

from server.models.layer_spec import UnsupportedModelError
from server.models.loader import load_model
from server.models.moe import BlockQuantExperts, SparseMoeBlock
from server.quant.block_linear import BlockQuantLinear

PPL_RATIO = 1.02  # the dense int8 bound (tests/quant/test_quant_accuracy.py BOUNDS["int8"])
MAX_NATS = 0.15  # any one token; measured up to 0.078 on these models


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_int8_experts_prompt_logprobs_within_the_dense_int8_bound(
    tmp_path: Path, smollm2_dir: Path, kind: str
) -> None:
    folder = build(tmp_path / kind, smollm2_dir, kind)
    ref, q = moe_engine(folder), moe_engine(folder, quantize="int8")
    assert q.loaded.quantization == "int8"
    blocks = [m for m in q.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == {"mixtral": 4, "qwen2_moe": 3}[kind]
    for b in blocks:
        assert isinstance(b.experts, BlockQuantExperts) and b.w13 is None and b.w2 is None
        assert {w.fmt for w in b.experts.w13 + b.experts.w2} == {"int8"}
        assert b.router.dtype == torch.float32  # routed in full precision
        assert b.shared_w13 is None and b.shared_w2 is None
        if kind == "qwen2_moe":
            assert b.shared_gate is not None and b.shared_gate.dtype == torch.float32
            assert all(
                isinstance(m, BlockQuantLinear) and m.weight_q.fmt == "int8"
                for m in (b.shared_gate_up, b.shared_down)
            )
    moe = q.loaded.arch.moe
    assert moe is not None
    fp32_experts = len(blocks) * moe.num_experts * 3 * moe.hidden_size * moe.intermediate_size * 4
    # weight_bytes counts the int8 experts (and the int8 attention): at least 3/4 of the experts' fp32 saved
    assert ref.loaded.weight_bytes - q.loaded.weight_bytes > 0.75 * fp32_experts
    ours = torch.cat([engine_prompt_logprobs(q, q.tokenizer.encode(p)) for p in PROMPTS])
    theirs = torch.cat([engine_prompt_logprobs(ref, ref.tokenizer.encode(p)) for p in PROMPTS])
    diff = (ours - theirs).abs()
    assert 1e-4 < diff.max().item() < MAX_NATS, diff.max()  # quantized, and close
    ratio = torch.exp((theirs - ours).mean()).item()  # perplexity int8 / unquantized
    assert 1 / PPL_RATIO < ratio < PPL_RATIO, ratio
    assert q.stats().num_free_blocks == q.stats().num_total_blocks


def test_mxfp4_experts_with_quantize_are_refused(tmp_path: Path) -> None:
    """gpt-oss's shipped experts are MXFP4 already: --quantize int8 would quantize them twice."""
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        layer_types=["full_attention", "full_attention"],
    )  # fmt: skip
    folder = tmp_path / "gpt-oss"
    cfg.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    # refused from config.json alone, before any weight is read
    with pytest.raises(UnsupportedModelError, match="experts are MXFP4 already; --quantize int8"):
        load_model(folder, torch.float32, torch.device("cpu"), 64, "int8")
