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
    """The embedded model as a Hugging Face folder (converted from its GGUF on first use), or the folder
    KUBEINFER_TEST_SMOLLM2_DIR names: on the device machine (benchmarks/gpu_session.sh) the embedded
    model's 92 MB package cannot travel, and a random-weight folder of its shape with its tokenizer
    (benchmarks/real_shape_models.py's smollm2-135m) stands in; tests of the real weights' text fail there."""
    stand_in = os.environ.get("KUBEINFER_TEST_SMOLLM2_DIR")
    if stand_in:
        return Path(stand_in)
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
    head_dim: int | None = None,
) -> Path:
    """A random-weight Llama, Qwen2 or Qwen3 checkpoint with SmolLM2's tokenizer (so text round-trips).
    Qwen3: head_dim (default 32, so q is wider than hidden) and random q_norm / k_norm weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

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
    if arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=head_dim or 32)
    elif head_dim is not None:
        raise ValueError("head_dim is a Qwen3 option here")
    else:
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
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # ones would hide a missing weight
                p.normal_(1.0, 0.3)
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


@pytest.fixture(scope="session")
def qwen3_embed_dir(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny Qwen3-Embedding-style sentence-transformers folder (embedding_models.py)."""
    from embedding_models import build_qwen3_embedding

    return build_qwen3_embedding(
        tiny_model_factory("qwen3", tie=True), tmp_path_factory.mktemp("qwen3-embed")
    )
