"""Mixture-of-experts building blocks for architecture modules (docs/design.md, "Mixture of experts")."""

from server.models.moe.block import SparseMoeBlock, block_state, stack_checkpoint_experts
from server.models.moe.config import MoEConfig, MoEConfigError
from server.models.moe.layer import DenseExperts, ExpertGemms, FusedMoE, act_and_mul, default_gemm_dtype
from server.models.moe.mxfp4 import Mxfp4Experts, Mxfp4Tensor, dequantize_mxfp4, load_mxfp4_experts
from server.models.moe.quant import BlockQuantExperts, split_gguf_experts
from server.models.moe.routing import ExpertGroups, Routing, group_by_expert, select_experts
from server.models.moe.weights import ExpertWeights, SharedExpertWeights, load_expert_weights

__all__ = [
    "BlockQuantExperts",
    "DenseExperts",
    "ExpertGemms",
    "ExpertGroups",
    "ExpertWeights",
    "FusedMoE",
    "MoEConfig",
    "MoEConfigError",
    "Mxfp4Experts",
    "Mxfp4Tensor",
    "Routing",
    "SharedExpertWeights",
    "SparseMoeBlock",
    "act_and_mul",
    "block_state",
    "default_gemm_dtype",
    "dequantize_mxfp4",
    "group_by_expert",
    "load_expert_weights",
    "load_mxfp4_experts",
    "select_experts",
    "split_gguf_experts",
    "stack_checkpoint_experts",
]
