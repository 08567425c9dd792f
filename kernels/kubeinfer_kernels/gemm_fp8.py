"""fp8_gemm: activations x fp8 e4m3 weights with per-output-channel scales (weight-only fp8).

The weight tile is converted to the activation dtype in registers, multiplied with fp32 accumulation,
and the channel scale is applied once to the accumulator. On GPUs the fp8 conversion needs sm_89+.
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
def _fp8_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] float8_e4m3fn (nn.Linear layout)
    scale_ptr,  # [N] fp32
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x_m,
    stride_w_n,
    stride_o_m,
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
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows_m[:, None] * stride_x_m + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + rows_n[None, :] * stride_w_n + ks[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * scale[None, :]
    tl.store(
        out_ptr + rows_m[:, None] * stride_o_m + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def fp8_gemm(
    x: Tensor,  # [M, K] fp16/bf16/fp32
    weight: Tensor,  # [N, K] float8_e4m3fn
    scale: Tensor,  # [N] fp32, dequantized weight = weight * scale[:, None]
) -> Tensor:  # [M, N] in x.dtype: x @ (weight * scale[:, None]).T
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (torch.float8_e4m3fn,))
    check_dtype("scale", scale, (torch.float32,))
    check_shape("x", x, (None, None))
    m_dim, k_dim = x.shape
    check_shape("weight", weight, (None, k_dim))
    n_dim = weight.shape[0]
    check_shape("scale", scale, (n_dim,))
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    check_contiguous("scale", scale)
    device = check_devices((("x", x), ("weight", weight), ("scale", scale)))
    out = torch.empty((m_dim, n_dim), dtype=x.dtype, device=device)
    if m_dim == 0 or n_dim == 0:
        return out
    if k_dim == 0:
        return out.zero_()
    block_m = min(64, max(16, next_pow2(m_dim)))
    block_n = 64
    _fp8_gemm_kernel[(triton.cdiv(m_dim, block_m), triton.cdiv(n_dim, block_n))](
        x_ptr=x,
        w_ptr=weight,
        scale_ptr=scale,
        out_ptr=out,
        M=m_dim,
        N=n_dim,
        K=k_dim,
        stride_x_m=x.stride(0),
        stride_w_n=weight.stride(0),
        stride_o_m=out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        UPCAST=upcast_loads(x.dtype),
        PRECISION=dot_precision(x.dtype),
    )
    return out
