"""Quantization chosen at startup. The model loader calls exactly these five functions.

(Interim version: dense only. The quantization work replaces this module's bodies, keeping the API.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class QuantConfig:
    method: str
    is_prequantized: bool


def resolve_quant_config(
    flag: str | None, checkpoint_cfg: dict[str, Any] | None, device: torch.device
) -> QuantConfig | None:
    """--quantize and the checkpoint's quantization_config -> what to do (raises on conflicts)."""
    if flag is None and checkpoint_cfg is None:
        return None
    method = flag or (checkpoint_cfg or {}).get("quant_method")
    raise ValueError(f"quantization {method!r} is not supported by this build")


def prepare_for_checkpoint(model: nn.Module, qcfg: QuantConfig) -> None:
    """Before loading a pre-quantized checkpoint: swap Linear modules for ones whose tensors match it."""
    raise NotImplementedError(qcfg.method)


def keeps_dtype(tensor_name: str, qcfg: QuantConfig | None) -> bool:
    """Whether a checkpoint tensor must not be cast to the model dtype (packed ints, fp16 scales)."""
    return False


def finalize(model: nn.Module, qcfg: QuantConfig, dtype: torch.dtype) -> None:
    """After loading: quantize on the fly or repack pre-quantized tensors for the device."""
    raise NotImplementedError(qcfg.method)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights (parameters and buffers, each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
