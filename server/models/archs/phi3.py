"""Microsoft Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer over fused checkpoint tensors
(`self_attn.qkv_proj`: q, k, v rows in that order; `mlp.gate_up_proj`: gate rows then up rows), split
at load into the shared layers' q/k/v and gate/up (serving_weights fuses them again where it can);
`partial_rotary_factor` (only the leading channels of each head rotate), LongRoPE `rope_scaling`, and
a `sliding_window` on every layer. Source: transformers' modeling_phi3.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture

if TYPE_CHECKING:
    from torch import Tensor


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    window = cfg.get("sliding_window")
    spec = replace(base.layers[0], sliding_window=int(window) if window else None)
    return replace(base, layers=(spec,) * base.num_layers)


def rename_weights(state: dict[str, Tensor], arch: ArchConfig) -> dict[str, Tensor]:
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, w in zip(("q_proj", "k_proj", "v_proj"), t.split((q, kv, kv)), strict=True):
                out[f"{prefix}{part}.weight"] = w
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            for part, w in zip(("gate_proj", "up_proj"), t.split((inter, inter)), strict=True):
                out[f"{prefix}{part}.weight"] = w
        else:
            out[name] = t
    return out


PHI3 = Architecture(
    "Phi3ForCausalLM",
    "phi3",
    configure,
    ("fused qkv/gate_up weights", "partial rotary", "LongRoPE", "sliding window"),
    rename_weights=rename_weights,
)
