"""int4_gemm: activations x 4-bit weights, dequantized inside the kernel, fp32 accumulation.

One weight layout: AWQ GEMM (qweight int32 [K, N/8], nibble j of a word = column [0,2,4,6,1,3,5,7][j]
of its 8, qzeros packed the same way, scales [K/G, N]). GPTQ checkpoints are repacked into it at load
time with `kubeinfer_kernels.reference.gptq_to_awq` (zeros get their +1 back, qweight moves from K- to N-packing);
GPTQ act-order survives as `g_idx`, which makes the kernel gather each K row's group instead of
deriving it as k // G.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kubeinfer_kernels._common import (
    FLOAT_DTYPES,
    check_contiguous,
    check_devices,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    dot_precision,
    next_pow2,
    upcast_loads,
)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K, N // 8] int32, AWQ nibble order
    qzeros_ptr,  # [K // GROUP_SIZE, N // 8] int32, AWQ nibble order
    scales_ptr,  # [K // GROUP_SIZE, N]
    g_idx_ptr,  # [K] int32, read only when HAS_G_IDX
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x_m,
    stride_o_m,
    GROUP_SIZE: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    words_per_row = N // 8
    word = offs_n // 8
    # Column c of its 8 lives in nibble [0, 4, 1, 5, 2, 6, 3, 7][c]: evens in nibbles 0-3, odds in 4-7.
    shift = (((offs_n % 8) % 2) * 4 + (offs_n % 8) // 2) * 4  # [BLOCK_N]
    rows_m = offs_m.to(tl.int64)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows_m[:, None] * stride_x_m + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        qw = tl.load(
            qweight_ptr + ks[:, None].to(tl.int64) * words_per_row + word[None, :], mask=kn_mask, other=0
        )
        q = (qw >> shift[None, :]) & 0xF  # [BLOCK_K, BLOCK_N]
        if HAS_G_IDX:
            # Act-order: rows of one tile belong to arbitrary groups, so zeros and scales are gathered per row.
            g = tl.load(g_idx_ptr + ks, mask=k_mask, other=0)
            qz = tl.load(qzeros_ptr + g[:, None] * words_per_row + word[None, :], mask=kn_mask, other=0)
            sc = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=kn_mask, other=0.0)
            z = (qz >> shift[None, :]) & 0xF
            w = (q - z).to(tl.float32) * sc.to(tl.float32)
        else:
            # BLOCK_K divides GROUP_SIZE, so the whole tile shares one group row.
            g0 = k0 // GROUP_SIZE
            qz = tl.load(qzeros_ptr + g0 * words_per_row + word, mask=n_mask, other=0)
            sc = tl.load(scales_ptr + g0 * N + offs_n, mask=n_mask, other=0.0)
            z = (qz >> shift) & 0xF
            w = (q - z[None, :]).to(tl.float32) * sc.to(tl.float32)[None, :]
        if UPCAST:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)

    tl.store(
        out_ptr + rows_m[:, None] * stride_o_m + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int4_gemm(
    x: Tensor,  # [M, K] fp16/bf16/fp32
    qweight: Tensor,  # [K, N // 8] int32, AWQ nibble order
    qzeros: Tensor,  # [K // group_size, N // 8] int32, AWQ nibble order
    scales: Tensor,  # [K // group_size, N] fp16 (bf16/fp32 accepted)
    group_size: int,
    g_idx: Tensor | None = None,  # [K] int32 group of each input channel (GPTQ act-order), None = k // G
) -> Tensor:  # [M, N] in x.dtype: x @ ((q - zero) * scale)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("qweight", qweight, (torch.int32,))
    check_dtype("qzeros", qzeros, (torch.int32,))
    check_dtype("scales", scales, FLOAT_DTYPES)
    check_shape("x", x, (None, None))
    m_dim, k_dim = x.shape
    check_shape("qweight", qweight, (k_dim, None))
    n_dim = qweight.shape[1] * 8
    if group_size < 16 or k_dim % group_size:
        raise ValueError(f"group_size {group_size} must be >= 16 and divide K={k_dim}")
    check_shape("qzeros", qzeros, (k_dim // group_size, n_dim // 8))
    check_shape("scales", scales, (k_dim // group_size, n_dim))
    check_last_dim_contiguous("x", x)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        check_contiguous(name, t)
    named = [("x", x), ("qweight", qweight), ("qzeros", qzeros), ("scales", scales)]
    if g_idx is not None:
        check_shape("g_idx", g_idx, (k_dim,))
        check_dtype("g_idx", g_idx, (torch.int32,))
        check_contiguous("g_idx", g_idx)
        named.append(("g_idx", g_idx))
    device = check_devices(named)
    out = torch.empty((m_dim, n_dim), dtype=x.dtype, device=device)
    if m_dim == 0 or n_dim == 0:
        return out
    if k_dim == 0:
        return out.zero_()
    block_m = min(64, max(16, next_pow2(m_dim)))
    block_n = 64
    # Largest power of two <= 64 dividing the group size, so a tile never straddles two groups.
    block_k = min(64, group_size & -group_size)
    if block_k < 16:
        raise ValueError(f"group_size {group_size} must be a multiple of 16")
    _int4_gemm_kernel[(triton.cdiv(m_dim, block_m), triton.cdiv(n_dim, block_n))](
        x_ptr=x,
        qweight_ptr=qweight,
        qzeros_ptr=qzeros,
        scales_ptr=scales,
        g_idx_ptr=qweight if g_idx is None else g_idx,  # any pointer; never read without HAS_G_IDX
        out_ptr=out,
        M=m_dim,
        N=n_dim,
        K=k_dim,
        stride_x_m=x.stride(0),
        stride_o_m=out.stride(0),
        GROUP_SIZE=group_size,
        HAS_G_IDX=g_idx is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast_loads(x.dtype),
        PRECISION=dot_precision(x.dtype),
    )
    return out
