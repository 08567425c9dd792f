"""Microsoft Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer over fused checkpoint tensors
(`self_attn.qkv_proj`: q, k, v rows in that order; `mlp.gate_up_proj`: gate rows then up rows), split
at load into the shared layers' q/k/v and gate/up (serving_weights fuses them again where it can);
`partial_rotary_factor` (only the leading channels of each head rotate), LongRoPE `rope_scaling`, and
a `sliding_window` on every layer. Source: transformers' modeling_phi3.py."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture
from server.models.layer_spec import UnsupportedModelError

if TYPE_CHECKING:
    from torch import Tensor

    from server.quant.cpu_qlinear import BlockQuantWeight


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    window = cfg.get("sliding_window")
    spec = replace(base.layers[0], sliding_window=int(window) if window else None)
    return replace(base, layers=(spec,) * base.num_layers)


def _split_rows(t: Tensor | BlockQuantWeight, sizes: tuple[int, ...]) -> list[Tensor | BlockQuantWeight]:
    """Row blocks of a dense [N, K] tensor or a GGUF's quantized one (its rows stay quantized)."""
    import torch

    from server.quant.cpu_qlinear import BlockQuantWeight

    if isinstance(t, BlockQuantWeight):
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        if bounds[-1] != t.out_features:
            raise UnsupportedModelError(
                f"a fused Phi-3 tensor has {t.out_features} rows, expected {bounds[-1]}"
            )
        return [t.select_rows(torch.arange(a, b)) for a, b in itertools.pairwise(bounds)]
    return list(t.split(sizes))


def rename_weights(state: dict[str, Tensor], arch: ArchConfig) -> dict[str, Tensor]:
    """HF's (and llama.cpp's attn_qkv / ffn_up) fused tensors -> q/k/v and gate/up. A GGUF's quantized
    tensors (BlockQuantWeight) split by rows too."""
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    out: dict[str, Any] = {}
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, w in zip(("q_proj", "k_proj", "v_proj"), _split_rows(t, (q, kv, kv)), strict=True):
                out[f"{prefix}{part}.weight"] = w
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            for part, w in zip(("gate_proj", "up_proj"), _split_rows(t, (inter, inter)), strict=True):
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
    gguf=True,
)
