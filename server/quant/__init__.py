"""Quantization chosen at startup. The model loader calls exactly these five functions:

resolve_quant_config -> prepare_for_checkpoint (pre-quantized only) -> keeps_dtype (per tensor) ->
finalize (after load_state_dict) -> weight_bytes.

Only the decoder's projections (q/k/v/o, gate/up/down) are quantized; embeddings, norms and lm_head stay
in the model dtype, as TGI and vLLM do.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from server.quant import cpu_repack
from server.quant.config import BLOCK_FORMATS, QuantConfig, resolve_quant_config
from server.quant.formats import Int4Weights, awq_decode, gptq_decode, pick_group_size, quantize_rtn
from server.quant.layers import (
    AwqCheckpointLinear,
    BnbLinear,
    Fp8CheckpointLinear,
    Fp8Linear,
    GptqCheckpointLinear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
)

__all__ = [
    "QuantConfig",
    "finalize",
    "iter_projections",
    "keeps_dtype",
    "prepare_for_checkpoint",
    "quantized_layer_bytes",
    "resolve_quant_config",
    "weight_bytes",
]

log = logging.getLogger(__name__)

PROJECTION_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")


@dataclass(frozen=True)
class Projection:
    name: str  # e.g. model.layers.3.self_attn.q_proj
    parent: nn.Module
    attr: str
    module: nn.Module


def iter_projections(model: nn.Module) -> Iterator[Projection]:
    """The decoder's projection layers (whatever their current class), in model order."""
    for name, module in list(model.named_modules()):
        if PROJECTION_RE.match(name):
            parent_name, _, attr = name.rpartition(".")
            yield Projection(name, model.get_submodule(parent_name), attr, module)


def _skipped(name: str, qcfg: QuantConfig) -> bool:
    return any(part and part in name for part in qcfg.modules_to_not_convert)


def prepare_for_checkpoint(model: nn.Module, qcfg: QuantConfig) -> None:
    """Before loading a pre-quantized checkpoint: swap projections for modules whose tensors match it."""
    for p in iter_projections(model):
        lin = p.module
        if not isinstance(lin, nn.Linear) or _skipped(p.name, qcfg):
            continue
        device = lin.weight.device
        has_bias = lin.bias is not None
        new: nn.Module
        group = lin.in_features if qcfg.group_size == -1 else qcfg.group_size
        if qcfg.method == "awq":
            new = AwqCheckpointLinear(lin.in_features, lin.out_features, group, has_bias, device)
        elif qcfg.method == "gptq":
            new = GptqCheckpointLinear(lin.in_features, lin.out_features, group, has_bias, device)
        elif qcfg.method == "fp8":
            new = Fp8CheckpointLinear(lin.in_features, lin.out_features, has_bias, device)
        else:
            raise ValueError(f"{qcfg.method} is not a pre-quantized checkpoint format")
        setattr(p.parent, p.attr, new)


def keeps_dtype(tensor_name: str, qcfg: QuantConfig | None) -> bool:
    """Whether a checkpoint tensor must not be cast to the model dtype."""
    if qcfg is None:
        return False
    module_name, _, leaf = tensor_name.rpartition(".")
    if not PROJECTION_RE.match(module_name) or _skipped(module_name, qcfg):
        return False
    if qcfg.method in ("awq", "gptq") and qcfg.is_prequantized:
        return leaf == "scales"  # fp16 on disk, used as such
    if qcfg.method == "fp8" and qcfg.is_prequantized:
        return leaf in ("weight", "weight_scale")
    # On-the-fly: quantize from the checkpoint's own precision, not from a bf16 rounding of it.
    return leaf == "weight"


def _bias(module: nn.Module, dtype: torch.dtype) -> Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().to(dtype)


def _int4(w: Int4Weights, bias: Tensor | None, name: str) -> QuantLinear:
    """On CPU the weight-only kernel's int4 layout when it holds `w` (cpu_repack.py), else Int4Linear."""
    if w.intweight.device.type == "cpu" and cpu_repack.cpu_kernel_enabled():
        problem = cpu_repack.int4_layout_problem(w)
        if problem is None:
            return cpu_repack.int4_linear(w, bias)
        log.info("%s keeps torch's int4 path: %s", name, problem)
    return Int4Linear(w, bias)


def _convert(module: nn.Module, qcfg: QuantConfig, dtype: torch.dtype, name: str) -> nn.Module | None:
    bias = _bias(module, dtype)
    if isinstance(module, AwqCheckpointLinear):
        w = awq_decode(module.qweight, module.qzeros, module.scales, module.group_size)
        return _int4(w, bias, name)
    if isinstance(module, GptqCheckpointLinear):
        w = gptq_decode(
            module.qweight, module.qzeros, module.scales, module.g_idx, module.group_size, qcfg.zero_offset
        )
        return _int4(w, bias, name)
    if isinstance(module, Fp8CheckpointLinear):
        scale = module.weight_scale.float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(module.out_features)
        if scale.numel() != module.out_features:
            raise ValueError(
                f"fp8 weight_scale has {scale.numel()} values; expected 1 or {module.out_features}"
            )
        return Fp8Linear(module.weight, scale.contiguous(), bias, cpu_repack.kernels_wanted())
    if not isinstance(module, nn.Linear) or qcfg.is_prequantized:
        return None
    weight = module.weight.detach()  # [N, K]
    if qcfg.method == "int8":
        if weight.device.type == "cpu" and cpu_repack.cpu_kernel_enabled():
            return cpu_repack.int8_linear(*cpu_repack.quantize_int8(weight), bias)
        return Int8Linear.quantize(weight, bias)
    if qcfg.method == "int4":
        return _int4(quantize_rtn(weight, pick_group_size(module.in_features, qcfg.group_size)), bias, name)
    if qcfg.method == "fp8":
        return Fp8Linear.quantize(weight, bias, cpu_repack.kernels_wanted())
    if qcfg.method in BLOCK_FORMATS:
        if module.in_features % 32:
            raise ValueError(
                f"--quantize {qcfg.method} needs in_features divisible by 32, got {module.in_features}"
            )
        from server.quant.block_linear import BlockQuantLinear
        from server.quant.cpu_qlinear import quantize_block

        return BlockQuantLinear(quantize_block(weight, qcfg.method), bias)
    if qcfg.method.startswith("bitsandbytes"):
        # bitsandbytes computes in the model dtype (on this CPU fp32 prefill is ~4x faster than bf16).
        return BnbLinear(weight, bias, qcfg.bnb_quant_type, dtype)
    raise ValueError(f"no on-the-fly quantization for {qcfg.method!r}")


def finalize(model: nn.Module, qcfg: QuantConfig, dtype: torch.dtype) -> None:
    """After loading: quantize projections on the fly, or repack pre-quantized tensors for the device."""
    for p in iter_projections(model):
        if _skipped(p.name, qcfg):
            if isinstance(p.module, nn.Linear):
                p.module.to(dtype)
            continue
        new = _convert(p.module, qcfg, dtype, p.name)
        if new is not None:
            setattr(p.parent, p.attr, new)
    leftovers = [p.name for p in iter_projections(model) if not isinstance(p.module, QuantLinear | nn.Linear)]
    assert not leftovers, f"unconverted checkpoint layers: {leftovers[:3]}"


def _persistent_tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters(recurse=False)
    for name, buf in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            yield buf
    # weights a module holds outside its parameters and buffers (a MoE block's quantized experts)
    held = getattr(module, "held_weight_tensors", None)
    if callable(held):
        yield from held()


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights (each storage counted once; caches such as RoPE tables excluded)."""
    # Modules inside a BnbLinear (bitsandbytes' own Linear) are counted by its weight_nbytes().
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, BnbLinear):
            inside.update(id(sub) for sub in module.modules() if sub is not module)
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, BnbLinear):
            total += module.weight_nbytes()
            continue
        # Other quantized modules count their buffers here, by storage: a tied quantized embedding and
        # LM head share theirs.
        for t in _persistent_tensors(module):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def quantized_layer_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the projection layers hold now, bytes they would hold as fp16): the quantization's own ratio."""
    held = 0
    fp16 = 0
    for p in iter_projections(model):
        m = p.module
        if isinstance(m, QuantLinear):
            held += m.weight_nbytes()
            fp16 += 2 * (
                m.in_features * m.out_features
                + (m.out_features if getattr(m, "bias", None) is not None else 0)
            )
        elif isinstance(m, nn.Linear):
            held += sum(t.numel() * t.element_size() for t in m.parameters())
            fp16 += 2 * sum(t.numel() for t in m.parameters())
    return held, fp16
