"""Tiny random Mixtral / Qwen2-MoE / Qwen3-MoE Hugging Face folders built with transformers' own classes
(4 layers, 8 experts, top-2, GQA), our engine over them and transformers' greedy reference (shared by
the MoE architecture tests)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from engine_driver import TOKENIZER_FILES

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "In 1969, the first humans landed on the Moon. The mission was called",
]
MAX_LEN = 256
LOGPROB_TOL = 2e-4  # fp32 both sides; attention and expert sums in another order
KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def moe_config(kind: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-5,
        num_experts_per_tok=2,
    )
    if kind == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=64, num_local_experts=8)
    if kind == "qwen2_moe":
        # layer 1 dense (mlp_only_layers), a shared expert, no renormalisation (its shipped default)
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    # every second layer sparse (decoder_sparse_step 2: layers 1 and 3), renormalised top-k, q/k norms
    common["head_dim"] = 16
    return tf.Qwen3MoeConfig(
        **common,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        decoder_sparse_step=2,
        norm_topk_prob=True,
    )


def build(out: Path, tokenizer_from: Path, kind: str, seed: int = 0, **sizes: int) -> Path:
    """`sizes`: config attributes to override (the k-quant GGUF test's multiples of 256)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = moe_config(kind)
    for key, value in sizes.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # larger-than-default weights so greedy argmax and the router are not decided by noise; norms
        # away from 1 so a missing norm weight shows
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def moe_engine(folder: Path, num_kv_blocks: int = 128, quantize: str | None = None, **kw: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN, quantize=quantize),
            cache=CacheConfig(block_size=4, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True),
            max_num_batched_tokens=8,  # prompts are chunked, and chunks share steps with decodes
            **kw,
        )
    )
