"""AllenAI OLMo 2: norms on the sub-block outputs (`post_attention_layernorm`,
`post_feedforward_layernorm`; no input norm) and q/k RMSNorms over the whole projection output
(`q_norm`: [Hq * D], `k_norm`: [Hkv * D]) before RoPE. Source: transformers' modeling_olmo2.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    spec = replace(base.layers[0], norm_placement="post", qk_norm="full")
    return replace(base, layers=(spec,) * base.num_layers)


OLMO2 = Architecture(
    "Olmo2ForCausalLM", "olmo2", configure, ("post-norms", "q/k norm over the projection"), gguf=True
)
