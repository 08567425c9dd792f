"""MXFP4 expert weights as gpt-oss ships them, multiplied straight from the packed bytes on CPU.

Layout (OCP Microscaling spec v1.0; transformers' integrations/mxfp4.py `convert_moe_packed_tensors`):
`{name}_blocks [E, N, K / 32, 16]` uint8 holds 32 e2m1 values per block, two per byte, the low nibble
first (element 2j in the low nibble of byte j); `{name}_scales [E, N, K / 32]` uint8 is each block's
shared e8m0 exponent, biased by 127: value = e2m1 * 2 ** (scale - 127). Rows N are output features:
`gate_up_proj` is [E, 2I, H / 32, 16] with gate and up interleaved (even rows gate), `down_proj`
[E, H, I / 32, 16]. The format's code (dequantization, the CPU kernel) is server/quant/cpu_mxfp4.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from server.models.moe.config import MoEConfig
from server.models.moe.native import (
    ACTIVATIONS,
    KIND_MXFP4,
    FusedExpertsCall,
    KiMoeExperts,
    fused_enabled,
    try_load_moe_experts_kernel,
)
from server.quant.cpu_mxfp4 import (
    E2M1_VALUES,
    MXFP4_BLOCK,
    Mxfp4Kernel,
    dequantize_mxfp4,
    try_load_mxfp4_kernel,
)

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK",
    "Mxfp4Experts",
    "Mxfp4Tensor",
    "dequantize_mxfp4",
    "load_mxfp4_experts",
]


@dataclass(frozen=True)
class Mxfp4Tensor:
    """One stacked MXFP4 weight [E, N, K] still packed."""

    blocks: Tensor  # [E, N, K / 32, 16] uint8
    scales: Tensor  # [E, N, K / 32] uint8

    def expert(self, e: int) -> Tensor:  # -> [N, K] fp32
        return dequantize_mxfp4(self.blocks[e], self.scales[e])

    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()


class Mxfp4Experts:
    """ExpertGemms over MXFP4 weights: expert e's w13 / w2 multiply straight from their packed bytes
    through the CPU kernel (`kernel`, server/quant/cpu_mxfp4.py), so a step reads only its chosen
    experts' 4.25 bits per weight; without the kernel (None: no compiler, or a tensor off the CPU) the
    expert is dequantized to fp32 for the call (the reference path). Both are fp32 sums of exact
    weights: they differ only in summation order."""

    def __init__(
        self,
        w13: Mxfp4Tensor,
        w2: Mxfp4Tensor,
        b13: Tensor | None,
        b2: Tensor | None,
        kernel: Mxfp4Kernel | None = None,
    ) -> None:
        self.w13 = w13  # [E, 2I, H] gate rows then up rows
        self.w2 = w2  # [E, H, I]
        self.b13 = None if b13 is None else b13.float().contiguous()  # [E, 2I]
        self.b2 = None if b2 is None else b2.float().contiguous()  # [E, H]
        self.kernel = kernel if w13.blocks.device.type == "cpu" else None
        self._call: tuple[tuple[object, ...], FusedExpertsCall] | None = None

    def _linear(self, x: Tensor, w: Mxfp4Tensor, e: int, bias: Tensor | None) -> Tensor:
        # x: [n, K] -> [n, N] fp32
        b = None if bias is None else bias[e]
        if self.kernel is not None:
            return self.kernel.linear(x.float().contiguous(), w.blocks[e], w.scales[e], b)
        y = F.linear(x.float(), w.expert(e))
        return y if b is None else y + b

    def nbytes(self) -> int:
        return self.w13.nbytes() + self.w2.nbytes()

    def fused_call(self, cfg: MoEConfig) -> FusedExpertsCall | None:
        """The block's experts for the native call (server/models/moe/native.py) over the MXFP4 kernel's
        entry point; None without that kernel or the call's library, or under KUBEINFER_MOE_FUSED=0."""
        if not isinstance(self.kernel, Mxfp4Kernel) or not fused_enabled():
            return None
        key = (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        if self._call is not None and self._call[0] == key:
            return self._call[1]
        lib = try_load_moe_experts_kernel()
        if lib is None:
            return None
        parts = [self.w13.blocks, self.w13.scales, self.w2.blocks, self.w2.scales]
        if not all(t.is_contiguous() for t in parts):
            return None
        entry = ctypes.cast(self.kernel.lib.kubeinfer_mxfp4_linear, ctypes.c_void_p).value
        spec = KiMoeExperts(
            kind=KIND_MXFP4,
            activation=ACTIVATIONS[cfg.activation],
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
            num_experts=self.w13.blocks.shape[0],
            hidden=self.w13.blocks.shape[2] * MXFP4_BLOCK,
            inter=self.w2.blocks.shape[2] * MXFP4_BLOCK,
            w13=self.w13.blocks.data_ptr(),
            w13_scales=self.w13.scales.data_ptr(),
            w2=self.w2.blocks.data_ptr(),
            w2_scales=self.w2.scales.data_ptr(),
            b13=None if self.b13 is None else self.b13.data_ptr(),
            b2=None if self.b2 is None else self.b2.data_ptr(),
            mxfp4=entry,
        )
        call = FusedExpertsCall(lib, spec, (*parts, self.b13, self.b2))
        self._call = (key, call)
        return call

    def fused_entry(self) -> int:
        """0: the MXFP4 entry point is in the call's spec (no int8 switch applies to it)."""
        return 0

    def tensors(self) -> list[Tensor]:
        """Every packed tensor the experts hold (SparseMoeBlock.held_weight_tensors)."""
        return [self.w13.blocks, self.w13.scales, self.w2.blocks, self.w2.scales]

    def gate_up(self, e: int, x: Tensor) -> Tensor:  # x: [n, H] fp32 -> [n, 2I] fp32
        return self._linear(x, self.w13, e, self.b13)

    def down(self, e: int, h: Tensor) -> Tensor:  # h: [n, I] fp32 -> [n, H] fp32
        return self._linear(h, self.w2, e, self.b2)


def load_mxfp4_experts(
    tensors: Mapping[str, Tensor], prefix: str, cfg: MoEConfig, use_kernel: bool = True
) -> Mxfp4Experts:
    """gpt-oss's `{prefix}.experts.{gate_up_proj,down_proj}_{blocks,scales}` and biases; the interleaved
    gate/up rows are reordered to gate | up (rows are quantized independently, so this is exact).
    `use_kernel`: run the CPU kernel where it builds (try_load_mxfp4_kernel), else the reference path.
    Raises KeyError naming a missing tensor, ValueError on a shape mismatch."""
    p = f"{prefix}.experts."
    try:
        gu_b, gu_s = tensors[p + "gate_up_proj_blocks"], tensors[p + "gate_up_proj_scales"]
        d_b, d_s = tensors[p + "down_proj_blocks"], tensors[p + "down_proj_scales"]
        b13, b2 = tensors[p + "gate_up_proj_bias"], tensors[p + "down_proj_bias"]
    except KeyError as e:
        raise KeyError(f"checkpoint tensor {e.args[0]!r} missing") from None
    e_, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    for name, t, shape in (
        ("gate_up_proj_blocks", gu_b, (e_, 2 * i, h // MXFP4_BLOCK, 16)),
        ("down_proj_blocks", d_b, (e_, h, i // MXFP4_BLOCK, 16)),
        ("gate_up_proj_bias", b13, (e_, 2 * i)),
        ("down_proj_bias", b2, (e_, h)),
    ):
        if tuple(t.shape) != shape or h % MXFP4_BLOCK or i % MXFP4_BLOCK:
            raise ValueError(f"{p}{name}: expected {shape} (H and I multiples of 32), got {tuple(t.shape)}")
    order = torch.cat([torch.arange(0, 2 * i, 2), torch.arange(1, 2 * i, 2)])
    return Mxfp4Experts(
        Mxfp4Tensor(gu_b[:, order].contiguous(), gu_s[:, order].contiguous()),
        Mxfp4Tensor(d_b.contiguous(), d_s.contiguous()),
        b13[:, order],
        b2,
        try_load_mxfp4_kernel() if use_kernel else None,
    )
