"""fused_moe: a mixture-of-experts block's expert GEMMs as two grouped Triton GEMMs (vLLM's fused_moe shape).

The T * top_k token-expert pairs are sorted by expert and each expert's run padded to BLOCK_M
(`moe_align_block_size`), so every BLOCK_M-row tile of the sorted list belongs to one expert: a program
loads its tile's rows (token pair // top_k for the first GEMM, the pair itself for the second), that
expert's weight tile, and writes rows back to their pair's slot. Padding slots hold T * top_k and are
masked. GEMM 1: x @ w13[e].T (+ b13[e]) -> [T * top_k, 2I]; the activation in torch; GEMM 2:
act @ w2[e].T (+ b2[e]) times the pair's routing weight -> [T * top_k, H], summed over top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kubeinfer_kernels._common import (
    FLOAT_DTYPES,
    check_contiguous,
    check_devices,
    check_dtype,
    check_shape,
    dot_precision,
    upcast_loads,
)

MOE_ACTIVATIONS = ("silu", "swigluoai")


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x ([T, K], A_DIV = top_k) or the activations ([T * top_k, K], A_DIV = 1)
    b_ptr,  # [E, N, K]
    bias_ptr,  # [E, N] fp32, read only when HAS_BIAS
    w_ptr,  # [T * top_k] fp32 routing weights, read only when MUL_WEIGHT
    c_ptr,  # [T * top_k, N]
    sorted_ptr,  # [P] int32 pair indices grouped by expert, padded with num_pairs
    block_expert_ptr,  # [P // BLOCK_M] int32 expert of each tile
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_bias_e,
    A_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    row_a = tl.where(valid, pair // A_DIV, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + row_a.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + pair, mask=valid, other=0.0)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def moe_align_block_size(
    topk_ids: Tensor,  # [T, top_k] int32/int64 expert ids in [0, num_experts)
    num_experts: int,
    block_m: int,
) -> tuple[
    Tensor, Tensor
]:  # (sorted pairs [P] int32 padded with T * top_k, expert of each tile [P // block_m] int32)
    """Pairs grouped by expert (stable), each expert's run padded to a multiple of `block_m` (vLLM's
    `moe_align_block_size`, here in torch: one sort and one bincount; it syncs once for the counts)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum().item())
    pad_start = torch.cumsum(padded, 0) - padded  # [E] first slot of each expert's run
    run_start = torch.cumsum(counts, 0) - counts  # [E] first index of each expert in `order`
    sorted_experts = flat[order]
    slot = pad_start[sorted_experts] + (
        torch.arange(num_pairs, device=flat.device) - run_start[sorted_experts]
    )
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[slot] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device, dtype=torch.int32), padded // block_m
    )
    return sorted_ids, tile_expert


def _grouped_gemm(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    weights: Tensor | None,
    sorted_ids: Tensor,
    tile_expert: Tensor,
    num_pairs: int,
    a_div: int,
    block_m: int,
) -> Tensor:  # [num_pairs, N] in a's dtype
    n_dim, k_dim = b.shape[1], b.shape[2]
    out = torch.zeros((num_pairs, n_dim), dtype=a.dtype, device=a.device)
    if tile_expert.numel() == 0 or n_dim == 0:
        return out
    block_n = 32 if n_dim <= 32 else 64
    block_k = 32 if k_dim <= 32 else 64
    _grouped_gemm_kernel[(tile_expert.numel(), triton.cdiv(n_dim, block_n))](
        a_ptr=a,
        b_ptr=b,
        bias_ptr=b if bias is None else bias,  # any pointer; never read without HAS_BIAS
        w_ptr=b if weights is None else weights,
        c_ptr=out,
        sorted_ptr=sorted_ids,
        block_expert_ptr=tile_expert,
        N=n_dim,
        K=k_dim,
        num_pairs=num_pairs,
        stride_am=a.stride(0),
        stride_be=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=out.stride(0),
        stride_bias_e=0 if bias is None else bias.stride(0),
        A_DIV=a_div,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast_loads(a.dtype),
        PRECISION=dot_precision(a.dtype),
    )
    return out


def moe_activation(h: Tensor, activation: str, alpha: float, limit: float) -> Tensor:  # [n, 2I] -> [n, I]
    """gate | up halves -> SiLU(gate) * up, or gpt-oss's clamped SwiGLU (transformers GptOssExperts)."""
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(
    x: Tensor,  # [T, H] fp16/bf16/fp32
    w13: Tensor,  # [E, 2I, H] x's dtype: gate rows then up rows
    w2: Tensor,  # [E, H, I] x's dtype
    topk_weights: Tensor,  # [T, top_k] fp32
    topk_ids: Tensor,  # [T, top_k] int32, in [0, E)
    activation: str = "silu",  # "silu" | "swigluoai"
    b13: Tensor | None = None,  # [E, 2I] fp32
    b2: Tensor | None = None,  # [E, H] fp32
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> Tensor:  # [T, H] in x.dtype: sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t])
    """Raises TypeError on a dtype and ValueError on a shape, device, layout or activation the kernel
    cannot take. Expert ids out of range are not checked on the device (it would cost a sync)."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    t_dim, h_dim = x.shape
    check_shape("w13", w13, (None, None, h_dim))
    e_dim, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2:
        raise ValueError(f"w13: second dimension {two_i} must be 2 * intermediate_size")
    check_shape("w2", w2, (e_dim, h_dim, two_i // 2))
    check_shape("topk_ids", topk_ids, (t_dim, None))
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    check_dtype("w13", w13, (x.dtype,))
    check_dtype("w2", w2, (x.dtype,))
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} not in {MOE_ACTIVATIONS}")
    named = [("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)]
    for name, bias, shape in (("b13", b13, (e_dim, two_i)), ("b2", b2, (e_dim, h_dim))):
        if bias is not None:
            check_shape(name, bias, shape)
            check_dtype(name, bias, (torch.float32,))
            named.append((name, bias))
    for name, t in named:
        check_contiguous(name, t)
    check_devices(named)
    top_k = topk_ids.shape[1]
    num_pairs = t_dim * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16
    sorted_ids, tile_expert = moe_align_block_size(topk_ids, e_dim, block_m)
    h = _grouped_gemm(x, w13, b13, None, sorted_ids, tile_expert, num_pairs, top_k, block_m)
    act = moe_activation(h.float(), activation, swiglu_alpha, swiglu_limit).to(x.dtype).contiguous()
    y = _grouped_gemm(act, w2, b2, topk_weights.reshape(-1), sorted_ids, tile_expert, num_pairs, 1, block_m)
    return y.view(t_dim, top_k, h_dim).float().sum(1).to(x.dtype)
