"""Mixtral: the Mistral layer (GQA, RoPE, a `sliding_window` on every layer when set) whose MLP is a
mixture of experts on every layer: a router over `num_local_experts` experts, softmax, the top
`num_experts_per_tok` renormalised (server/models/moe/config.py), SwiGLU experts. Checkpoints name
the block `block_sparse_moe` (`gate`, `experts.N.w1/w3/w2`); it loads into the shared layer's `mlp`.
Source: transformers' modeling_mixtral.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture
from server.models.layer_spec import UnsupportedModelError
from server.models.moe.block import stack_checkpoint_experts
from server.models.moe.config import MoEConfig, MoEConfigError

if TYPE_CHECKING:
    from torch import Tensor


def moe_config(cfg: dict[str, Any]) -> MoEConfig:
    try:
        return MoEConfig.from_config_json(cfg)
    except MoEConfigError as e:
        raise UnsupportedModelError(str(e)) from e


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    layers = tuple(replace(spec, mlp="moe") for spec in base.layers)
    return replace(base, layers=layers, moe=moe_config(cfg))


def rename_weights(state: dict[str, Tensor], arch: ArchConfig) -> dict[str, Tensor]:
    assert arch.moe is not None
    return stack_checkpoint_experts(state, range(arch.num_layers), arch.moe, block="block_sparse_moe")


MIXTRAL = Architecture(
    "MixtralForCausalLM",
    "mixtral",
    configure,
    ("mixture of experts (top-k of E, renormalised)", "sliding window"),
    gguf=True,
    rename_weights=rename_weights,
)
