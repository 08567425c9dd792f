"""int8, int4, AWQ and GPTQ weights repacked at load for the CPU weight-only kernel (csrc/qlinear.cpp).

Our other quantized formats run on CPU through the same kernel as GGUF's blocks, with fp32 activations
and fp32 accumulation (torch's own int8/int4 CPU kernels, the previous path, compute in bf16, which this
AVX2-only CPU emulates):

- int8 per output channel: w[n, k] = q[n, k] * scale[n] -> the kernel's `int8` layout, one group of K;
- int4 group-wise with zero points (AWQ GEMM, GPTQ v1/v2, our round-to-nearest --quantize int4):
  w[k, n] = (q[k, n] - z[g, n]) * s[g, n] -> the kernel's `int4` layout, w = s * q + m with m = -z * s
  held in fp32 (s is fp16 on disk, so s * q is exact and m rounds once; a GPTQ v1 zero of 16 is fine);
- GPTQ act-order (desc_act, g_idx not k // G): the rows of the weight are sorted by group once, which
  makes g_idx trivial, and each call gathers x's columns in that order (`ActOrderBlockQuantLinear`).

What the kernel cannot take keeps the previous path (layers.Int4Linear): group sizes that are not a
multiple of 32 or a K that is not, g_idx whose groups are not all `group_size` long, or no compiler.
Sources of the formats: formats.py's docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import BLOCK, BlockQuantWeight, from_int4, from_int8, try_load_qlinear_kernel
from server.quant.formats import Int4Weights

_enabled = True


@contextlib.contextmanager
def previous_cpu_path() -> Iterator[None]:
    """Within this block, models load with the previous CPU layers (torch's bf16 int4/int8 kernels): for
    benchmarks and tests that compare both paths in one process."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


def kernels_wanted() -> bool:
    """Whether layers converted now take the compiled CPU kernels: False inside previous_cpu_path()."""
    return _enabled


def cpu_kernel_enabled() -> bool:
    """Whether load-time repacking for the CPU kernel is on and the kernel could be built."""
    return _enabled and try_load_qlinear_kernel() is not None


class ActOrderBlockQuantLinear(BlockQuantLinear):
    """A BlockQuantLinear whose weight's K was reordered at load: y = x[..., perm] @ W_perm^T + bias.

    Not fused with its neighbours (each GPTQ act-order layer has its own order)."""

    perm: Tensor  # [K] int64: position j of the reordered weight holds input channel perm[j]

    def __init__(
        self,
        w: BlockQuantWeight,
        perm: Tensor,  # [K] int64
        bias: Tensor | None = None,  # [N]
        cache_dir: Path | None = None,
    ) -> None:
        super().__init__(w, bias, cache_dir)
        if tuple(perm.shape) != (w.in_features,) or perm.dtype != torch.int64:
            raise ValueError(f"perm must be [{w.in_features}] int64, got {tuple(perm.shape)} {perm.dtype}")
        self.register_buffer("perm", perm.contiguous())
        self.method = "int4-act-order"

    def forward(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:  # [..., K] -> [..., N]
        return super().forward(x.index_select(-1, self.perm), out_dtype)

    def weight_nbytes(self) -> int:
        return super().weight_nbytes() + self.perm.numel() * self.perm.element_size()


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of a [N, K] float weight -> (q [N, K] int8, scale [N] fp32),
    w ~ q * scale[n] with scale = max|w[n]| / 127 (round to nearest, as layers.Int8Linear.quantize but
    with the fp32 scale the kernel reads, not a bf16 one)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_linear(qweight: Tensor, scale: Tensor, bias: Tensor | None) -> BlockQuantLinear:
    """qweight [N, K] int8, scale [N] float, bias [N] or None -> the kernel's int8 layer."""
    return BlockQuantLinear(from_int8(qweight.contiguous(), scale.float()), bias)


def int4_layout_problem(w: Int4Weights) -> str | None:
    """Why the kernel's int4 layout cannot hold `w` (then the previous path serves it), or None."""
    if w.group_size % BLOCK or w.in_features % BLOCK:
        return f"group_size {w.group_size} and K {w.in_features} must be multiples of {BLOCK}"
    counts = torch.bincount(w.g_idx.long(), minlength=w.in_features // w.group_size)
    if counts.numel() != w.in_features // w.group_size or not bool((counts == w.group_size).all()):
        return "g_idx groups are not all group_size long"
    return None


def int4_linear(w: Int4Weights, bias: Tensor | None) -> BlockQuantLinear:
    """Int4Weights (trivial or act-order g_idx, checked by int4_layout_problem) -> the kernel's int4 layer."""
    problem = int4_layout_problem(w)
    if problem is not None:
        raise ValueError(f"int4 weights cannot be repacked for the CPU kernel: {problem}")
    if w.has_trivial_g_idx():
        return BlockQuantLinear(from_int4(w.intweight, w.zeros, w.scales, w.group_size), bias)
    # Sorting input channels by group (stable) puts group g at rows g*G..(g+1)*G-1: g_idx becomes k // G.
    perm = torch.argsort(w.g_idx.long(), stable=True)
    block = from_int4(w.intweight.index_select(0, perm), w.zeros, w.scales, w.group_size)
    return ActOrderBlockQuantLinear(block, perm, bias)
