"""What an architecture module (server/models/archs/) provides to the registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from server.models.arch import ArchConfig


@dataclass(frozen=True)
class Architecture:
    """One architecture. `qkv_bias`: q/k/v carry a bias without `attention_bias` (Qwen2); `qk_norm`:
    the common parse sets per-head q/k norms (Qwen3); `gguf`: a GGUF file of it loads (llama.cpp's
    tensor names mapped); `features`: what its layers use, for docs/models.md."""

    name: str
    model_type: str
    configure: Callable[[dict[str, Any], ArchConfig], ArchConfig]
    features: tuple[str, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf: bool = False
    # its layers are the Llama layer (LayerSpec.is_llama): tensor parallelism, calibrated quantization
    llama_layer: bool = False
    rename_weights: Callable[[dict[str, Tensor], ArchConfig], dict[str, Tensor]] | None = None
    # Runs before rename_weights on the model built on the meta device: takes the checkpoint tensors
    # some modules keep in their own packed form (gpt-oss's MXFP4 experts on CPU) out of the state and
    # hands them to those modules, whose parameters they replace; returns the rest of the state.
    attach_weights: (
        Callable[[nn.Module, dict[str, Tensor], ArchConfig, torch.device], dict[str, Tensor]] | None
    ) = None
