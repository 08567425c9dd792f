"""IBM Granite (3.x dense): the Llama layer with four scalars from config.json: `embedding_multiplier`
(embeddings), `residual_multiplier` (each sub-block's output before the residual add),
`attention_multiplier` (the softmax scale, in place of head_dim**-0.5) and `logits_scaling` (logits are
divided by it). Source: transformers' modeling_granite.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    spec = replace(
        base.layers[0],
        attn_scale=float(cfg.get("attention_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
    )
    return replace(
        base,
        layers=(spec,) * base.num_layers,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logits_divisor=float(cfg.get("logits_scaling", 1.0)),
    )


GRANITE = Architecture(
    "GraniteForCausalLM",
    "granite",
    configure,
    ("embedding/residual/attention/logits multipliers",),
    gguf=True,
)
