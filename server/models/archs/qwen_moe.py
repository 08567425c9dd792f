"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen2 /
Qwen3 layer (q/k/v bias / per-head q/k norms) whose MLP is a mixture of experts on the sparse layers:
layer i is sparse unless it is in `mlp_only_layers`, and only where `(i + 1) % decoder_sparse_step == 0`
(transformers' rule); the other layers keep the dense MLP of `intermediate_size`. Routing: softmax
over `num_experts`, top `num_experts_per_tok`, renormalised only with `norm_topk_prob`; Qwen2-MoE adds a
shared expert of `shared_expert_intermediate_size` scaled by sigmoid(shared_expert_gate(x)).
Sources: transformers' modeling_qwen2_moe.py, modeling_qwen3_moe.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture
from server.models.archs.mixtral import moe_config
from server.models.layer_spec import UnsupportedModelError
from server.models.moe.block import stack_checkpoint_experts

if TYPE_CHECKING:
    from torch import Tensor


def sparse_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers whose MLP is the MoE block (transformers' Qwen2MoeDecoderLayer rule)."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if experts <= 0:
        return ()
    return tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    if cfg.get("use_sliding_window"):
        # transformers' Qwen2-MoE windows alternate layers below max_window_layers, Qwen3-MoE every
        # layer; no shipped checkpoint turns it on
        raise UnsupportedModelError(f"{base.architecture} with use_sliding_window is not supported")
    sparse = set(sparse_layers(cfg, base.num_layers))
    layers = tuple(replace(s, mlp="moe" if i in sparse else "dense") for i, s in enumerate(base.layers))
    arch = replace(base, layers=layers, moe=moe_config(cfg) if sparse else None)
    if base.model_type == "qwen2_moe":
        # Qwen2-MoE's q/k/v bias is `qkv_bias` (default true), not `attention_bias`
        arch = replace(arch, qkv_bias=bool(cfg.get("qkv_bias", True)))
    return arch


def rename_weights(state: dict[str, Tensor], arch: ArchConfig) -> dict[str, Tensor]:
    if arch.moe is None:
        return state
    sparse = [i for i, s in enumerate(arch.layers) if s.mlp == "moe"]
    return stack_checkpoint_experts(state, sparse, arch.moe, block="mlp")


ARCHITECTURES = [
    Architecture(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        configure,
        ("q/k/v bias", "mixture of experts + shared expert", "dense layers (mlp_only_layers)"),
        qkv_bias=True,
        gguf=True,
        rename_weights=rename_weights,
    ),
    Architecture(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        configure,
        ("per-head q/k norm", "mixture of experts", "dense layers (mlp_only_layers)"),
        qk_norm=True,
        gguf=True,
        rename_weights=rename_weights,
    ),
]
