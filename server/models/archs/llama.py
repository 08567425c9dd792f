"""Llama, Mistral, Qwen2 and Qwen3: the Llama layer the common config parse already describes
(Qwen2: q/k/v bias; Qwen3: per-head q/k RMSNorm, set by the entry's flags)."""

from __future__ import annotations

from typing import Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture


def _as_is(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    return base


ARCHITECTURES = [
    Architecture("LlamaForCausalLM", "llama", _as_is, ("RoPE scaling",), gguf=True, llama_layer=True),
    Architecture("MistralForCausalLM", "mistral", _as_is, ("RoPE scaling",), gguf=True, llama_layer=True),
    Architecture(
        "Qwen2ForCausalLM", "qwen2", _as_is, ("q/k/v bias",), qkv_bias=True, gguf=True, llama_layer=True
    ),
    Architecture(
        "Qwen3ForCausalLM", "qwen3", _as_is, ("per-head q/k norm",), qk_norm=True, gguf=True, llama_layer=True
    ),
]
