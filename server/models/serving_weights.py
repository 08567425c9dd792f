"""Rearranges loaded weights for serving speed; the model computes the same function afterwards.

Two steps, both applied by the engine after `load_model` (the quantizer and the tests that inspect
modules by their Hugging Face names load without them):

- **Fusion**: q/k/v and gate/up projections that are all plain `nn.Linear` (or all BlockQuantLinear of
  one format: GGUF served quantized) become one module each, so a step runs 2 matmuls instead of 5 per
  layer over the same input (~20% faster prefill on CPU, fewer kernel launches on GPU, fewer OpenMP
  regions in a decode step). Other quantized projections keep their names and stay separate.
- **CPU weight pre-packing**: fp32 Linear weights, and bf16 ones where the CPU computes bf16 natively
  (AVX512-BF16 or AMX: a bf16 folder served under `--dtype auto`), are reordered once into oneDNN's
  blocked layout. On CPU, `F.linear` re-packs the weight inside every call; with the layout done at
  load time the same matmul runs 1.3-2.2x faster in fp32 (the vocabulary projection gains the most)
  and 1.03-1.36x in bf16 at 16 rows (Llama-3.2-1B shapes, Zen 4), with bit-identical outputs.
  Where the CPU has AVX512-BF16, bf16 weights go to server/models/cpu_bf16_gemm.py's panels instead
  (`KUBEINFER_BF16_GEMM=0`: oneDNN's): one resident copy read faster at decode-sized rows, outputs within
  one bf16 ulp of oneDNN's (another fp32 summation order).
- **bf16 GEMMs around an fp32 stream** (`bf16_gemms`, decoder embedders under `--dtype auto` on CPUs with
  native bf16): fp32 Linear weights held as bf16 in oneDNN's layout instead (server/models/bf16_linear.py).
- **Fused layer ops** (CPU, fp32; bf16 where every MLP is dense, `ArchConfig.fused_cpu_bf16`):
  the model gets the compiled add+RMSNorm, rotary and silu*up calls of server/models/cpu_fused.py, ~10
  calls per layer instead of ~35 torch ops in a decode step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from server.cpu_env import release_free_heap
from server.models.bf16_linear import Bf16GemmLinear
from server.models.cpu_bf16_gemm import Bf16GemmKernel, Bf16PanelLinear, try_load_fast_bf16_gemm
from server.models.cpu_fused import try_load_fused_ops
from server.models.layers import MLP
from server.models.llama import LlamaForCausalLM
from server.native import KernelBuildError, env_switch, usable_cpu_features
from server.quant.block_linear import BlockQuantLinear

log = logging.getLogger(__name__)

BF16_GEMM_ENV = "KUBEINFER_BF16_GEMM"


@dataclass(frozen=True)
class ServingWeightsReport:
    fused_projections: int  # fused Linear modules created (qkv + gate_up)
    packed_linears: int  # Linear modules whose weight was pre-packed for the CPU


class PackedLinear(nn.Module):
    """Drop-in for an fp32 or bf16 `nn.Linear` on CPU whose weight lives in oneDNN's pre-packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor, not a parameter: it cannot be moved, saved or read back.
        self.packed_weight: Tensor = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias: Tensor | None = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:  # x: [T, in_features] weight's dtype -> [T, out_features]
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def cpu_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Linear weights of `dtype` on `device` are pre-packed: fp32 on any x86 CPU with oneDNN,
    bf16 where oneDNN runs bf16 (AVX-512 and up: torch's own gate for its mkldnn bf16 ops, which
    F.linear takes there too, so packing changes no result). `--dtype auto` serves bf16 only where
    the CPU computes it natively (loader.cpu_has_native_bf16)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_panel_kernel(cache_dir: Path | None = None) -> Bf16GemmKernel | None:
    """cpu_bf16_gemm's kernel for bf16 weights where it runs AVX512-BF16, unless KUBEINFER_BF16_GEMM is `0`,
    or it is unset and AMX-BF16 is usable: oneDNN's pre-packed GEMM runs on AMX tiles there, 1.9x the panels
    at 16 rows and 8-10x at 256-2,048 on Llama-3.2-1B's matrices (the panels 1.2x at one row), and a bf16
    folder served with the panels prefilled at a tenth of vLLM's rate (2-core Xeon with AMX,
    benchmarks/bf16_gemm.py, docs/benchmarks-log.md "AMX at real shapes"); `1` asks for the panels there
    too. None: oneDNN packs them (read where used: tests flip it per case)."""
    switch = env_switch(BF16_GEMM_ENV)
    if switch is False or (switch is None and _amx_bf16(cache_dir)):
        return None
    return try_load_fast_bf16_gemm(cache_dir)


def _amx_bf16(cache_dir: Path | None) -> bool:
    try:
        return usable_cpu_features(cache_dir).amx_bf16
    except (KernelBuildError, OSError):  # no probe, no kernels: try_load_fast_bf16_gemm says None too
        return False


def _fuse(linears: list[nn.Module]) -> nn.Module | None:
    if all(type(m) is BlockQuantLinear for m in linears):
        return BlockQuantLinear.fuse(linears)  # type: ignore[arg-type]
    if not all(type(m) is nn.Linear for m in linears):
        return None
    parts: list[nn.Linear] = linears  # type: ignore[assignment]
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        return None
    w = parts[0].weight
    fused = nn.Linear(
        w.shape[1], sum(p.out_features for p in parts), bias=has_bias[0], device=w.device, dtype=w.dtype
    )
    fused.weight.data = torch.cat([p.weight.detach() for p in parts])
    if fused.bias is not None:
        fused.bias.data = torch.cat([p.bias.detach() for p in parts])  # type: ignore[misc]
    fused.requires_grad_(False)
    return fused


def prepare_for_serving(
    model: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: Path | None = None,
    bf16_gemms: bool = False,
) -> ServingWeightsReport:
    """Fuses and pre-packs in place (see the module docstring); on CPU in fp32 also gives the model the
    compiled fused layer ops (server/models/cpu_fused.py), built under `cache_dir` (None: the default).
    `bf16_gemms` (fp32 weights, a CPU where oneDNN runs bf16): the Linear weights are held as bf16 and
    multiplied in bf16 (server/models/bf16_linear.py) around the fp32 residual stream. ValueError where that
    cannot run."""
    if bf16_gemms and not (dtype == torch.float32 and cpu_packing_supported(device, torch.bfloat16)):
        raise ValueError(
            f"bf16 GEMMs need fp32 weights on a CPU where oneDNN runs bf16, got {dtype} on {device}"
        )
    fused = 0
    for layer in model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            attn.qkv_proj = qkv
            del attn.q_proj, attn.k_proj, attn.v_proj
            fused += 1
        if not isinstance(mlp, MLP):
            continue  # a mixture-of-experts block: its experts are stacked already
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        if gate_up is not None:
            mlp.gate_up_proj = gate_up
            del mlp.gate_proj, mlp.up_proj
            fused += 1
    packed = 0
    if cpu_packing_supported(device, dtype):
        panels = bf16_panel_kernel(cache_dir) if dtype == torch.bfloat16 else None
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.weight.dtype == dtype:
                    packed_linear: nn.Module
                    if bf16_gemms:
                        packed_linear = Bf16GemmLinear(child)
                    else:
                        packed_linear = (
                            PackedLinear(child) if panels is None else Bf16PanelLinear(child, panels)
                        )
                    setattr(parent, name, packed_linear)
                    packed += 1
    if device.type == "cpu" and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and model.config.fused_cpu_bf16)
    ):
        model.fused_ops = try_load_fused_ops(cache_dir)
    if device.type == "cpu":
        release_free_heap()  # the unfused weights, freed above
    report = ServingWeightsReport(fused_projections=fused, packed_linears=packed)
    log.info("serving weights: %d fused projections, %d pre-packed linears", fused, packed)
    return report
