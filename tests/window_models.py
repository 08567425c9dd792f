"""Tiny random sliding-window checkpoints for parity tests: a Mistral (every layer windowed) and a Qwen2
with `use_sliding_window` (layer 0 global, the rest windowed: the interleaved case), and a Gemma 3 (two
windowed layers, then a global one, Gemma 3's pattern) and a Gemma 2 (windowed, global, windowed: its
alternation, every layer's scores soft-capped), with SmolLM2's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from engine_driver import TOKENIZER_FILES

WINDOW = 16


def build_window_model(out: Path, tokenizer_from: Path, arch: str) -> Path:
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        sliding_window=WINDOW,
    )
    cfg: MistralConfig | Qwen2Config | Gemma3TextConfig | Gemma2Config
    if arch == "mistral":
        cfg = MistralConfig(**common)
    elif arch == "gemma3":  # layers 0 and 1 windowed (local RoPE base), layer 2 global
        cfg = Gemma3TextConfig(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    elif arch == "gemma2":  # layers 0 and 2 windowed, 1 global; a cap small enough to bend the scores
        cfg = Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    else:  # layer 0 global, layers 1 and 2 windowed
        cfg = Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # spread-out logits: greedy argmax is not decided by noise
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "bias" in str(p):
                p.normal_(0.0, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out
