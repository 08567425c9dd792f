"""Shared fixtures: the embedded SmolLM2 (converted once, cached) and tiny random-weight models."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_driver import TOKENIZER_FILES


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded model as a Hugging Face folder (converted from its GGUF on first use)."""
    from server.models.loader import resolve_model

    return resolve_model(None).folder


def build_tiny_model(
    out: Path,
    tokenizer_from: Path,
    arch: str = "llama",
    tie: bool = True,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
) -> Path:
    """A random-weight Llama or Qwen2 checkpoint with SmolLM2's tokenizer (so text round-trips)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    cfg = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights make logits spread out, so greedy argmax is not decided by noise.
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "bias" in str(p):
                p.normal_(0.0, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        src = tokenizer_from / name
        if src.exists():
            shutil.copy(src, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", tie: bool = True, **kw: int) -> Path:
        key = (arch, tie, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_tiny_model(out, smollm2_dir, arch=arch, tie=tie, **kw)
        return cache[key]

    return make
