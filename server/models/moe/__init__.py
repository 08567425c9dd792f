"""Mixture-of-experts building blocks for architecture modules (docs/design.md, "Mixture of experts")."""

from server.models.moe.config import MoEConfig, MoEConfigError
from server.models.moe.layer import DenseExperts, ExpertGemms, FusedMoE, act_and_mul, default_gemm_dtype
from server.models.moe.routing import ExpertGroups, Routing, group_by_expert, select_experts
from server.models.moe.weights import ExpertWeights, SharedExpertWeights, load_expert_weights

__all__ = [
    "DenseExperts",
    "ExpertGemms",
    "ExpertGroups",
    "ExpertWeights",
    "FusedMoE",
    "MoEConfig",
    "MoEConfigError",
    "Routing",
    "SharedExpertWeights",
    "act_and_mul",
    "default_gemm_dtype",
    "group_by_expert",
    "load_expert_weights",
    "select_experts",
]
