"""Tiny random transformers MoE blocks and their weights under checkpoint names (shared by the MoE tests)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

E, K, H, INTER, S = 8, 2, 64, 32, 48  # experts, top-k, hidden, expert intermediate, shared intermediate
PREFIX = "model.layers.0.mlp"


def hf_block(kind: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """(block, its config) with every parameter drawn from N(0, 0.5) under `seed`, fp32."""
    from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common: dict[str, Any] = {
        "hidden_size": H,
        "num_experts_per_tok": K,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    cfg: Any
    block: nn.Module
    if kind == "mixtral":
        cfg = MixtralConfig(num_local_experts=E, intermediate_size=INTER, **common)
        block = MixtralSparseMoeBlock(cfg)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(
            num_experts=E,
            moe_intermediate_size=INTER,
            shared_expert_intermediate_size=S,
            norm_topk_prob=False,
            **common,
        )
        block = Qwen2MoeSparseMoeBlock(cfg)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=E, moe_intermediate_size=INTER, norm_topk_prob=True, **common)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        cfg = GptOssConfig(num_local_experts=E, intermediate_size=INTER, num_key_value_heads=4, **common)
        block = GptOssMLP(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return block.eval(), cfg


def checkpoint_tensors(kind: str, block: nn.Module) -> dict[str, Tensor]:
    """The block's weights under the names its safetensors checkpoints use (transformers 5 fuses the
    per-expert tensors in memory; checkpoints keep them per expert, except gpt-oss)."""
    p = PREFIX + "."
    sd = {k: v.detach().clone() for k, v in block.state_dict().items()}
    if kind == "gpt_oss":
        return {p + k: v for k, v in sd.items()}
    out: dict[str, Tensor] = {p + "gate.weight": sd["gate.weight"]}
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]  # [E, 2I, H], [E, H, I]
    for e in range(E):
        out[f"{p}experts.{e}.{names[0]}.weight"] = gate_up[e, :INTER].clone()
        out[f"{p}experts.{e}.{names[1]}.weight"] = gate_up[e, INTER:].clone()
        out[f"{p}experts.{e}.{names[2]}.weight"] = down[e].clone()
    for k, v in sd.items():
        if k.startswith("shared_expert"):
            out[p + k] = v
    return out


def hf_routing(kind: str, block: nn.Module, x: Tensor) -> Tensor:  # x: [T, H] -> chosen ids [T, K]
    router: Any = block.router if kind == "gpt_oss" else block.gate
    return router(x)[2]
