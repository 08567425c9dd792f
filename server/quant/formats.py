"""4-bit group quantization and the two on-disk layouts that carry it: AWQ GEMM and GPTQ v1.

Everything here uses the x @ W layout of both formats: K = in features (rows), N = out features.
Layouts (docs/quantization.md, shared/docs/metrics-and-quant-formats.md):
- AWQ GEMM: qweight int32 [K, N/8], nibble j of a word holds column AWQ_PACK_ORDER[j] of its 8;
  qzeros int32 [K/G, N/8] packed the same way; scales fp16 [K/G, N].
- GPTQ v1: qweight int32 [K/8, N] packed along K in natural nibble order; qzeros int32 [K/G, N/8] natural
  order along N, holding zero - 1; scales fp16 [K/G, N]; g_idx int32 [K] (act-order when desc_act).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Nibble j of an AWQ word holds column AWQ_PACK_ORDER[j] of its group of 8 columns.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NATURAL_ORDER = tuple(range(8))
MAXQ = 15


@dataclass(frozen=True)
class Int4Weights:
    """Unpacked 4-bit group quantization of a [K, N] weight: w[k, n] = (q[k, n] - z[g, n]) * s[g, n], g = g_idx[k]."""

    intweight: Tensor  # [K, N] int32 in 0..15
    zeros: Tensor  # [K // group_size, N] int32; 0..15, or 16 when read from a GPTQ v1 file that wrapped a zero of 0
    scales: Tensor  # [K // group_size, N] fp16
    g_idx: Tensor  # [K] int32, group of each input channel
    group_size: int

    def __post_init__(self) -> None:
        k_dim, n_dim = self.intweight.shape
        if k_dim % self.group_size:
            raise ValueError(f"K={k_dim} is not a multiple of group_size={self.group_size}")
        groups = k_dim // self.group_size
        if tuple(self.zeros.shape) != (groups, n_dim) or tuple(self.scales.shape) != (groups, n_dim):
            raise ValueError(
                f"zeros {tuple(self.zeros.shape)} / scales {tuple(self.scales.shape)} must be {(groups, n_dim)}"
            )
        if tuple(self.g_idx.shape) != (k_dim,):
            raise ValueError(f"g_idx {tuple(self.g_idx.shape)} must be ({k_dim},)")

    @property
    def in_features(self) -> int:
        return int(self.intweight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.intweight.shape[1])

    def has_trivial_g_idx(self) -> bool:
        trivial = torch.arange(self.in_features, device=self.g_idx.device) // self.group_size
        return bool(torch.equal(self.g_idx.long(), trivial))


def dequantize(w: Int4Weights) -> Tensor:  # [K, N] fp32
    g = w.g_idx.long()
    return (w.intweight - w.zeros[g]).float() * w.scales.float()[g]


def trivial_g_idx(k_dim: int, group_size: int, device: torch.device | None = None) -> Tensor:  # [K] int32
    return (torch.arange(k_dim, device=device) // group_size).to(torch.int32)


# ------------------------------------------------------------------ packing


def _as_int32_bits(words: Tensor) -> Tensor:
    """int64 words holding 32 unsigned bits -> int32 with the same bits (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int4_cols(values: Tensor, order: tuple[int, ...]) -> Tensor:
    """[R, C] ints in 0..15 -> [R, C/8] int32; nibble j (bits 4j..4j+3) holds column order[j] of each 8."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"{cols} columns cannot be packed 8 to a word")
    if int(values.min()) < 0 or int(values.max()) > MAXQ:
        raise ValueError("4-bit values must be in 0..15")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64, device=values.device)
    for j, c in enumerate(order):
        words |= v[:, :, c] << (4 * j)
    return _as_int32_bits(words)


def unpack_int4_cols(words: Tensor, order: tuple[int, ...]) -> Tensor:
    """Inverse of pack_int4_cols: [R, C/8] int32 -> [R, C] int32 in 0..15."""
    rows, nwords = words.shape
    out = torch.empty(rows, nwords, 8, dtype=torch.int32, device=words.device)
    for j, c in enumerate(order):
        # Arithmetic shift sign-extends, the mask drops those bits.
        out[:, :, c] = (words >> (4 * j)) & 0xF
    return out.reshape(rows, nwords * 8)


def pack_int4_rows(values: Tensor) -> Tensor:
    """[R, C] ints in 0..15 -> [R/8, C] int32, natural nibble order along rows (GPTQ qweight)."""
    return pack_int4_cols(values.t(), NATURAL_ORDER).t().contiguous()


def unpack_int4_rows(words: Tensor) -> Tensor:
    """Inverse of pack_int4_rows: [R/8, C] int32 -> [R, C] int32."""
    return unpack_int4_cols(words.t().contiguous(), NATURAL_ORDER).t().contiguous()


# ------------------------------------------------------------------ AWQ GEMM


@dataclass(frozen=True)
class AwqTensors:
    qweight: Tensor  # [K, N/8] int32
    qzeros: Tensor  # [K/G, N/8] int32
    scales: Tensor  # [K/G, N] fp16


def awq_encode(w: Int4Weights) -> AwqTensors:
    if not w.has_trivial_g_idx():
        raise ValueError("AWQ has no g_idx: act-order weights cannot be written as AWQ")
    if int(w.zeros.max()) > MAXQ:
        raise ValueError("AWQ zero points must fit in 4 bits")
    return AwqTensors(
        qweight=pack_int4_cols(w.intweight, AWQ_PACK_ORDER),
        qzeros=pack_int4_cols(w.zeros, AWQ_PACK_ORDER),
        scales=w.scales.to(torch.float16).contiguous(),
    )


def awq_decode(
    qweight: Tensor,  # [K, N/8] int32
    qzeros: Tensor,  # [K/G, N/8] int32
    scales: Tensor,  # [K/G, N] fp16
    group_size: int,
) -> Int4Weights:
    q = unpack_int4_cols(qweight, AWQ_PACK_ORDER)
    return Int4Weights(
        intweight=q,
        zeros=unpack_int4_cols(qzeros, AWQ_PACK_ORDER),
        scales=scales.to(torch.float16),
        g_idx=trivial_g_idx(q.shape[0], group_size, q.device),
        group_size=group_size,
    )


# ------------------------------------------------------------------ GPTQ v1


@dataclass(frozen=True)
class GptqTensors:
    qweight: Tensor  # [K/8, N] int32
    qzeros: Tensor  # [K/G, N/8] int32, zero - 1 (v1) or zero (v2)
    scales: Tensor  # [K/G, N] fp16
    g_idx: Tensor  # [K] int32


def gptq_encode(w: Int4Weights, zero_offset: int = 1) -> GptqTensors:
    """zero_offset 1 = the classic v1 format (AutoGPTQ, `checkpoint_format: gptq`), 0 = gptq_v2."""
    if int(w.zeros.min()) < zero_offset or int(w.zeros.max()) > MAXQ:
        # AutoGPTQ writes a zero of 0 as -1 and loaders read it back as 16: we never produce one.
        raise ValueError(f"GPTQ zero points must be in {zero_offset}..15")
    return GptqTensors(
        qweight=pack_int4_rows(w.intweight),
        qzeros=pack_int4_cols(w.zeros - zero_offset, NATURAL_ORDER),
        scales=w.scales.to(torch.float16).contiguous(),
        g_idx=w.g_idx.to(torch.int32).contiguous(),
    )


def gptq_decode(
    qweight: Tensor,  # [K/8, N] int32
    qzeros: Tensor,  # [K/G, N/8] int32
    scales: Tensor,  # [K/G, N] fp16
    g_idx: Tensor | None,  # [K] int32; None = k // G
    group_size: int,
    zero_offset: int = 1,
) -> Int4Weights:
    q = unpack_int4_rows(qweight)
    # No mask after the +1, like every v1 loader: a stored 15 (a wrapped zero of 0) reads as 16.
    zeros = unpack_int4_cols(qzeros, NATURAL_ORDER) + zero_offset
    if g_idx is None:
        g_idx = trivial_g_idx(q.shape[0], group_size, q.device)
    return Int4Weights(
        intweight=q,
        zeros=zeros,
        scales=scales.to(torch.float16),
        g_idx=g_idx.to(torch.int32),
        group_size=group_size,
    )


# ------------------------------------------------------------------ round to nearest


@dataclass(frozen=True)
class GroupParams:
    scales: Tensor  # [..., N] fp32 (already rounded through fp16, so what is stored is what is used)
    zeros: Tensor  # [..., N] int32


def group_params(
    w_min: Tensor,  # [..., N] fp32 smallest weight of each (group, column)
    w_max: Tensor,  # [..., N] fp32 largest
    sym: bool,
    min_zero: int = 0,
) -> GroupParams:
    """Scale and zero point of asymmetric (or GPTQ-symmetric, zero 8) 4-bit quantization.

    min_zero=1 keeps GPTQ v1 files free of the wrapped zero (see gptq_encode): a group whose range does
    not reach below zero gets zero 1 and a scale stretched so its maximum still fits.
    """
    w_min = w_min.clamp(max=0.0)
    w_max = w_max.clamp(min=0.0)
    if sym:
        amax = torch.maximum(w_min.abs(), w_max)
        # GPTQ's symmetric grid: zero 8, the range [-8s, 7s] with s = 2 * amax / 15.
        scales = (2 * amax / MAXQ).clamp(min=1e-8)
        scales = scales.half().float().clamp(min=torch.finfo(torch.float16).tiny)
        zeros = torch.full_like(scales, (MAXQ + 1) // 2, dtype=torch.int32)
        return GroupParams(scales, zeros)
    scales = ((w_max - w_min) / MAXQ).clamp(min=1e-8)
    if min_zero > 0:
        stretch = w_min > -scales * (min_zero - 0.5)
        scales = torch.where(stretch, (w_max / (MAXQ - min_zero)).clamp(min=1e-8), scales)
    scales = scales.half().float().clamp(min=torch.finfo(torch.float16).tiny)
    zeros = torch.round(-w_min / scales).clamp(min_zero, MAXQ).to(torch.int32)
    return GroupParams(scales, zeros)


def quantize_rtn(
    weight: Tensor,  # [N, K] float, nn.Linear layout
    group_size: int,
    sym: bool = False,
    min_zero: int = 0,
) -> Int4Weights:
    """Plain round-to-nearest 4-bit quantization per (group of K, output channel)."""
    n_dim, k_dim = weight.shape
    if k_dim % group_size:
        raise ValueError(f"in_features {k_dim} is not a multiple of group_size {group_size}")
    w = weight.float().t().reshape(k_dim // group_size, group_size, n_dim)  # [K/G, G, N]
    p = group_params(w.amin(dim=1), w.amax(dim=1), sym, min_zero)
    q = torch.round(w / p.scales[:, None, :] + p.zeros[:, None, :]).clamp(0, MAXQ).to(torch.int32)
    return Int4Weights(
        intweight=q.reshape(k_dim, n_dim),
        zeros=p.zeros,
        scales=p.scales.half(),
        g_idx=trivial_g_idx(k_dim, group_size, weight.device),
        group_size=group_size,
    )


def pick_group_size(in_features: int, preferred: int = 128) -> int:
    """The preferred group size if it divides K, else the largest of 64, 32 that does (SmolLM2: K = 576)."""
    for g in (preferred, 128, 64, 32):
        if g <= preferred and in_features % g == 0:
            return g
    raise ValueError(f"in_features {in_features} is not a multiple of 32: no 4-bit group size fits")
