"""Plain-torch twins of the Triton kernels, and the AWQ/GPTQ/fp8 packing helpers.

Everything here is written for clarity, not speed: the kernel tests compare against these, the torch
attention backend may reuse them, and the quantization tools use the pack/unpack helpers for their own
reference checks. Formats: /work/shared/docs/metrics-and-quant-formats.md (AWQ GEMM, GPTQ v1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# AWQ packs column AWQ_ORDER[j] of each group of 8 into nibble j of an int32.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Nibble holding column c: the inverse permutation of AWQ_ORDER.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
FP8_E4M3_MAX = 448.0


# ---------------------------------------------------------------- attention


def store_kv_cache_ref(
    k: Tensor,  # [T, num_kv_heads, head_dim]
    v: Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: Tensor,  # [T] int64, slot = block_id * block_size + offset; -1 = skip
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def paged_attention_ref(
    q: Tensor,  # [T, num_heads, head_dim], new tokens of all sequences concatenated
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], already holding the new tokens
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32, KV length including the new tokens
    query_start_loc: Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,  # [num_heads], any float dtype
    softcap: float = 0.0,
) -> Tensor:  # [T, num_heads, head_dim] in q.dtype
    """Causal attention inside each sequence's new tokens, full over its earlier cached tokens; fp32 math.
    `sliding_window` W: the query at position p sees keys p - W + 1 .. p only (transformers'
    sliding_window_overlay: kv_idx > q_idx - W). `sinks`: gpt-oss's attention sinks, one logit per head
    joining every softmax's denominator with no value row (transformers' `eager_attention_forward` for
    GptOss: the sink is concatenated as a last score column, dropped after the softmax). `softcap` > 0:
    scores cap * tanh(s / cap) before the mask (transformers' eager Gemma 2 attention)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0 or ctx == 0:
            continue
        blocks = block_tables[s, : math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        if sliding_window is not None:
            visible &= torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink_col = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.cat([scores, sink_col], dim=-1).softmax(dim=-1)[..., :-1]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_attention_decode_ref(
    q: Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,  # [num_heads]
    softcap: float = 0.0,
) -> Tensor:  # [num_seqs, num_heads, head_dim]
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale,
        sliding_window,
        sinks,
        softcap,
    )


# ---------------------------------------------------------------- int4 packing


@dataclass(frozen=True)
class Int4Quantized:
    """Unpacked asymmetric 4-bit quantization of a [K, N] weight (x @ w layout, K = in features)."""

    intweight: Tensor  # [K, N] int32 in 0..15
    zeros: Tensor  # [K // group_size, N] int32 in 0..15
    scales: Tensor  # [K // group_size, N] fp16
    g_idx: Tensor  # [K] int32, group of each input channel (a permutation of k // group_size for act-order)
    group_size: int


@dataclass(frozen=True)
class AwqWeights:
    """AWQ GEMM tensors; also the one layout `int4_gemm` runs (GPTQ is repacked into it at load time)."""

    qweight: Tensor  # [K, N // 8] int32, AWQ nibble order along N
    qzeros: Tensor  # [K // group_size, N // 8] int32, AWQ nibble order along N
    scales: Tensor  # [K // group_size, N] fp16
    group_size: int
    g_idx: Tensor | None = None  # [K] int32 when act-order (GPTQ desc_act) left groups non-contiguous


@dataclass(frozen=True)
class GptqWeights:
    qweight: Tensor  # [K // 8, N] int32, natural nibble order along K
    qzeros: Tensor  # [K // group_size, N // 8] int32, natural order along N, stored as zero - 1
    scales: Tensor  # [K // group_size, N] fp16
    g_idx: Tensor  # [K] int32


def _to_int32_words(words: Tensor) -> Tensor:
    """int64 words holding 32 unsigned bits -> int32 with the same bits (two's complement)."""
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def pack_cols(values: Tensor, order: tuple[int, ...] = tuple(range(8))) -> Tensor:
    """[R, C] ints in 0..15 -> [R, C // 8] int32; nibble j of a word holds column order[j] of its 8."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"columns ({cols}) must be a multiple of 8")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64, device=values.device)
    for j, c in enumerate(order):
        words |= (v[:, :, c] & 0xF) << (4 * j)
    return _to_int32_words(words)


def unpack_cols(words: Tensor, order: tuple[int, ...] = tuple(range(8))) -> Tensor:
    """Inverse of `pack_cols`: [R, C // 8] int32 -> [R, C] int32."""
    rows = words.shape[0]
    out = torch.empty(rows, words.shape[1], 8, dtype=torch.int32, device=words.device)
    for j, c in enumerate(order):
        out[:, :, c] = (words >> (4 * j)) & 0xF
    return out.reshape(rows, -1)


def pack_rows(values: Tensor) -> Tensor:
    """[R, C] ints in 0..15 -> [R // 8, C] int32, natural nibble order along rows (GPTQ qweight)."""
    return pack_cols(values.t().contiguous()).t().contiguous()


def unpack_rows(words: Tensor) -> Tensor:
    """Inverse of `pack_rows`: [R // 8, C] int32 -> [R, C] int32."""
    return unpack_cols(words.t().contiguous()).t().contiguous()


def quantize_int4(
    w: Tensor,  # [K, N] float, x @ w layout
    group_size: int,
    g_idx: Tensor | None = None,  # [K] int32 group per input channel (act-order); default k // group_size
) -> Int4Quantized:
    """Round-to-nearest asymmetric int4 per (group, output channel); a test/reference quantizer."""
    k_dim, n_dim = w.shape
    if k_dim % group_size or n_dim % 8:
        raise ValueError(f"K={k_dim} must divide by group_size={group_size} and N={n_dim} by 8")
    num_groups = k_dim // group_size
    if g_idx is None:
        g_idx = torch.arange(k_dim, device=w.device, dtype=torch.int32) // group_size
    wf = w.float()
    g_long = g_idx.long()
    w_min = torch.full((num_groups, n_dim), float("inf"), device=w.device)
    w_max = torch.full((num_groups, n_dim), float("-inf"), device=w.device)
    w_min = w_min.scatter_reduce(0, g_long[:, None].expand(-1, n_dim), wf, reduce="amin")
    w_max = w_max.scatter_reduce(0, g_long[:, None].expand(-1, n_dim), wf, reduce="amax")
    w_min, w_max = w_min.clamp(max=0.0), w_max.clamp(min=0.0)
    scales = ((w_max - w_min) / 15.0).clamp(min=1e-5).half()
    zeros = torch.round(-w_min / scales.float()).clamp(0, 15).to(torch.int32)
    q = torch.round(wf / scales.float()[g_long] + zeros[g_long].float()).clamp(0, 15).to(torch.int32)
    return Int4Quantized(
        intweight=q, zeros=zeros, scales=scales, g_idx=g_idx.to(torch.int32), group_size=group_size
    )


def dequantize_int4(quant: Int4Quantized) -> Tensor:  # [K, N] fp32
    g = quant.g_idx.long()
    return (quant.intweight - quant.zeros[g]).float() * quant.scales.float()[g]


def pack_awq(quant: Int4Quantized) -> AwqWeights:
    """AWQ GEMM packing. Non-trivial g_idx (AWQ itself never has one) is kept for `int4_gemm`."""
    trivial = torch.arange(quant.g_idx.numel(), device=quant.g_idx.device) // quant.group_size
    return AwqWeights(
        qweight=pack_cols(quant.intweight, AWQ_ORDER),
        qzeros=pack_cols(quant.zeros, AWQ_ORDER),
        scales=quant.scales,
        group_size=quant.group_size,
        g_idx=None if torch.equal(quant.g_idx.long(), trivial) else quant.g_idx.to(torch.int32),
    )


def dequantize_awq(
    qweight: Tensor,  # [K, N // 8] int32
    qzeros: Tensor,  # [K // group_size, N // 8] int32
    scales: Tensor,  # [K // group_size, N] fp16
    group_size: int,
    g_idx: Tensor | None = None,  # [K] int32
) -> Tensor:  # [K, N] fp32
    q = unpack_cols(qweight, AWQ_ORDER)
    z = unpack_cols(qzeros, AWQ_ORDER)
    g = torch.arange(q.shape[0], device=q.device) // group_size if g_idx is None else g_idx.long()
    return (q - z[g]).float() * scales.float()[g]


def pack_gptq(quant: Int4Quantized) -> GptqWeights:
    """GPTQ v1 packing: zeros stored minus one (a zero of 0 wraps to nibble 15, as AutoGPTQ writes it)."""
    return GptqWeights(
        qweight=pack_rows(quant.intweight),
        qzeros=pack_cols((quant.zeros - 1) & 0xF),
        scales=quant.scales,
        g_idx=quant.g_idx.to(torch.int32),
    )


def dequantize_gptq(
    qweight: Tensor,  # [K // 8, N] int32
    qzeros: Tensor,  # [K // group_size, N // 8] int32, zero - 1
    scales: Tensor,  # [K // group_size, N] fp16
    g_idx: Tensor,  # [K] int32
) -> Tensor:  # [K, N] fp32
    q = unpack_rows(qweight)
    z = unpack_cols(qzeros) + 1  # loaders add the one back without masking, so 15 reads as 16
    g = g_idx.long()
    return (q - z[g]).float() * scales.float()[g]


def gptq_to_awq(
    qweight: Tensor,  # [K // 8, N] int32
    qzeros: Tensor,  # [K // group_size, N // 8] int32, zero - 1
    scales: Tensor,  # [K // group_size, N] fp16
    g_idx: Tensor | None,  # [K] int32, None = k // group_size
    group_size: int,
) -> AwqWeights:
    """Load-time repack of a GPTQ checkpoint into the AWQ layout that `int4_gemm` runs.

    Act-order survives as `g_idx` (the kernel gathers each row's group); a g_idx equal to k // group_size
    is dropped so the common case takes the cheaper path.
    """
    q = unpack_rows(qweight)
    z = unpack_cols(qzeros) + 1
    if int(z.max()) > 15:
        raise ValueError("GPTQ zero point of 16 (stored 15 = zero 0 wrapped) cannot be represented in 4 bits")
    k_dim = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k_dim, device=q.device, dtype=torch.int32) // group_size
    quant = Int4Quantized(
        intweight=q, zeros=z, scales=scales, g_idx=g_idx.to(torch.int32), group_size=group_size
    )
    return pack_awq(quant)


def int4_gemm_ref(
    x: Tensor,  # [M, K] fp16/bf16/fp32
    qweight: Tensor,  # [K, N // 8] int32, AWQ order
    qzeros: Tensor,  # [K // group_size, N // 8] int32, AWQ order
    scales: Tensor,  # [K // group_size, N] fp16
    group_size: int,
    g_idx: Tensor | None = None,  # [K] int32
) -> Tensor:  # [M, N] in x.dtype
    w = dequantize_awq(qweight, qzeros, scales, group_size, g_idx)
    return (x.float() @ w).to(x.dtype)


# ---------------------------------------------------------------- fp8 / int8 weight-only


@dataclass(frozen=True)
class ChannelQuantized:
    weight: Tensor  # [N, K] float8_e4m3fn or int8 (nn.Linear layout)
    scale: Tensor  # [N] fp32, w ~= weight * scale[:, None]


def quantize_fp8_per_channel(w: Tensor) -> ChannelQuantized:  # w: [N, K] float
    amax = w.float().abs().amax(dim=1).clamp(min=1e-8)
    scale = amax / FP8_E4M3_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return ChannelQuantized(weight=q, scale=scale)


def fp8_gemm_ref(
    x: Tensor,  # [M, K] fp16/bf16/fp32
    weight: Tensor,  # [N, K] float8_e4m3fn
    scale: Tensor,  # [N] fp32
) -> Tensor:  # [M, N] in x.dtype
    w = weight.float() * scale.float()[:, None]
    return (x.float() @ w.t()).to(x.dtype)


# ---------------------------------------------------------------- LoRA


def lora_shrink_ref(
    x: Tensor,  # [T, in]
    lora_a: Tensor,  # [L * n * R, in]
    token_slots: Tensor,  # [T] int64, -1 = no adapter
    n: int,
    max_rank: int,
) -> Tensor:  # [T, n * R] fp32
    nr = n * max_rank
    h = torch.zeros(x.shape[0], nr, dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            h[t] = lora_a[slot * nr : (slot + 1) * nr].float() @ x[t].float()
    return h


def lora_expand_ref(
    h: Tensor,  # [T, n * R] fp32
    lora_b: Tensor,  # [L * n * R, out]
    token_slots: Tensor,  # [T] int64, -1 = no adapter
    y: Tensor,  # [T, out]
    n: int,
    max_rank: int,
) -> Tensor:  # a new [T, out] tensor in y's dtype
    nr = n * max_rank
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] = (y[t].float() + h[t] @ lora_b[slot * nr : (slot + 1) * nr].float()).to(y.dtype)
    return out


def fused_moe_ref(
    x: Tensor,  # [T, H]
    w13: Tensor,  # [E, 2I, H] gate rows then up rows
    w2: Tensor,  # [E, H, I]
    topk_weights: Tensor,  # [T, top_k] fp32
    topk_ids: Tensor,  # [T, top_k] int
    activation: str = "silu",  # "silu" | "swigluoai" (gpt-oss's clamped SwiGLU)
    b13: Tensor | None = None,  # [E, 2I]
    b2: Tensor | None = None,  # [E, H]
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> Tensor:  # [T, H] fp32
    """fused_moe's twin: every token-expert pair's weights gathered densely, fp32 throughout."""
    ids = topk_ids.long()
    g = torch.einsum("th,tknh->tkn", x.float(), w13.float()[ids])  # [T, top_k, 2I]
    if b13 is not None:
        g = g + b13.float()[ids]
    i = g.shape[-1] // 2
    gate, up = g[..., :i], g[..., i:]
    if activation == "silu":
        act = torch.nn.functional.silu(gate) * up
    else:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        act = (up + 1) * gate * torch.sigmoid(gate * swiglu_alpha)
    y = torch.einsum("tki,tkhi->tkh", act, w2.float()[ids])  # [T, top_k, H]
    if b2 is not None:
        y = y + b2.float()[ids]
    return (y * topk_weights.float()[..., None]).sum(1)
