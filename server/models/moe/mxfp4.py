"""MXFP4 expert weights as gpt-oss ships them, dequantized per expert on use (a torch path for now).

Layout (OCP Microscaling spec v1.0; transformers' integrations/mxfp4.py `convert_moe_packed_tensors`):
`{name}_blocks [E, N, K / 32, 16]` uint8 holds 32 e2m1 values per block, two per byte, the low nibble
first (element 2j in the low nibble of byte j); `{name}_scales [E, N, K / 32]` uint8 is each block's
shared e8m0 exponent, biased by 127: value = e2m1 * 2 ** (scale - 127). Rows N are output features:
`gate_up_proj` is [E, 2I, H / 32, 16] with gate and up interleaved (even rows gate), `down_proj`
[E, H, I / 32, 16].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from server.models.moe.config import MoEConfig

MXFP4_BLOCK = 32  # values per shared scale
# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(
    blocks: Tensor, scales: Tensor
) -> Tensor:  # [..., G, 16] u8, [..., G] u8 -> [..., G * 32] fp32
    """Raises ValueError when the shapes or dtypes are not MXFP4's."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + [16]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2] low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


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
    """ExpertGemms over MXFP4 weights: expert e's w13 / w2 are dequantized to fp32 when it has tokens,
    so a step reads only its chosen experts' packed bytes (a torch reference; a fused kernel is to come)."""

    def __init__(self, w13: Mxfp4Tensor, w2: Mxfp4Tensor, b13: Tensor | None, b2: Tensor | None) -> None:
        self.w13 = w13  # [E, 2I, H] gate rows then up rows
        self.w2 = w2  # [E, H, I]
        self.b13 = None if b13 is None else b13.float()  # [E, 2I]
        self.b2 = None if b2 is None else b2.float()  # [E, H]

    def gate_up(self, e: int, x: Tensor) -> Tensor:  # x: [n, H] fp32 -> [n, 2I] fp32
        y = F.linear(x, self.w13.expert(e))
        return y if self.b13 is None else y + self.b13[e]

    def down(self, e: int, h: Tensor) -> Tensor:  # h: [n, I] fp32 -> [n, H] fp32
        y = F.linear(h, self.w2.expert(e))
        return y if self.b2 is None else y + self.b2[e]


def load_mxfp4_experts(tensors: Mapping[str, Tensor], prefix: str, cfg: MoEConfig) -> Mxfp4Experts:
    """gpt-oss's `{prefix}.experts.{gate_up_proj,down_proj}_{blocks,scales}` and biases; the interleaved
    gate/up rows are reordered to gate | up (rows are quantized independently, so this is exact).
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
    )
