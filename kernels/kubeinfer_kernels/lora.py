"""LoRA shrink and expand for mixed-adapter batches (the punica / S-LoRA BGMV pattern).

Adapters sit in slots of two stacked weights (server/lora/layers.py's layout, n sub-projections of a fused
projection, R = max rank):
    lora_a [L * n * R, in]    rows [s*n*R, (s+1)*n*R) hold slot s's A of each sub-projection
    lora_b [L * n * R, out]   the same rows hold its B (scaling folded in), in the sub-projection's columns
Each token t carries the slot of its adapter, token_slots[t] (-1 = base model: no delta).
    shrink  h[t, :]  = lora_a[slot_t*n*R : (slot_t+1)*n*R] @ x[t]        h: [T, n*R] fp32
    expand  y[t, :] += h[t] @ lora_b[slot_t*n*R : (slot_t+1)*n*R]        y: [T, out], in place
One program per (token, output tile): the per-token gather that lets one launch serve every adapter.
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
    check_shape,
    next_pow2,
)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [L * NR, in]
    slots_ptr,  # [T] int64
    h_ptr,  # [T, NR] fp32
    in_features,
    stride_x_t,
    NR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        rows = slot * NR + offs_n
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x_t + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + rows[:, None].to(tl.int64) * in_features + offs_k[None, :],
                mask=(offs_n[:, None] < NR) & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t.to(tl.int64) * NR + offs_n, acc, mask=offs_n < NR)


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [T, NR] fp32
    b_ptr,  # [L * NR, out]
    slots_ptr,  # [T] int64
    y_ptr,  # [T, out], updated in place
    out_features,
    stride_y_t,
    NR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot < 0:  # base-model row: y stays exactly as the base projection left it
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, NR, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < NR
        h = tl.load(h_ptr + t.to(tl.int64) * NR + offs_k, mask=k_mask, other=0.0)
        b = tl.load(
            b_ptr + (slot * NR + offs_k[:, None]).to(tl.int64) * out_features + offs_n[None, :],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(h[:, None] * b, axis=0)
    y_ptrs = y_ptr + t.to(tl.int64) * stride_y_t + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=n_mask)


def _check_slots(token_slots: Tensor, num_tokens: int, num_slots: int) -> None:
    check_shape("token_slots", token_slots, (num_tokens,))
    check_dtype("token_slots", token_slots, (torch.int64,))
    check_contiguous("token_slots", token_slots)
    del num_slots  # slots are not bounds-checked here (that would sync); the LoRA manager assigns them


def lora_shrink(
    x: Tensor,  # [T, in], last dim contiguous
    lora_a: Tensor,  # [L * n * R, in] contiguous, x's dtype
    token_slots: Tensor,  # [T] int64, slot per token, -1 = no adapter
    n: int,  # sub-projections of the (fused) projection
    max_rank: int,  # R
) -> Tensor:  # [T, n * R] fp32; zero rows for tokens without an adapter
    """Per-token LoRA A projection. Raises TypeError/ValueError on bad dtypes, shapes or devices."""
    nr = n * max_rank
    num_tokens, in_features = x.shape
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("lora_a", lora_a, (x.dtype,))
    check_shape("lora_a", lora_a, (None, in_features))
    if lora_a.shape[0] % nr:
        raise ValueError(f"lora_a: {lora_a.shape[0]} rows is not a multiple of n * max_rank = {nr}")
    check_contiguous("lora_a", lora_a)
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"x: last dimension must have stride 1, got strides {x.stride()}")
    _check_slots(token_slots, num_tokens, lora_a.shape[0] // nr)
    check_devices((("x", x), ("lora_a", lora_a), ("token_slots", token_slots)))
    h = torch.empty(num_tokens, nr, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    block_n = min(next_pow2(nr), 64)
    _lora_shrink_kernel[(num_tokens, triton.cdiv(nr, block_n))](
        x, lora_a, token_slots, h, in_features, x.stride(0), NR=nr, BLOCK_N=block_n, BLOCK_K=128
    )
    return h


def lora_expand(
    h: Tensor,  # [T, n * R] fp32, from lora_shrink
    lora_b: Tensor,  # [L * n * R, out] contiguous
    token_slots: Tensor,  # [T] int64, slot per token, -1 = no adapter
    y: Tensor,  # [T, out], lora_b's dtype, last dim contiguous; updated in place
    n: int,
    max_rank: int,
) -> Tensor:  # y
    """y[t] += h[t] @ (token t's slot of lora_b). Rows without an adapter are left untouched."""
    nr = n * max_rank
    num_tokens, out_features = y.shape
    check_dtype("h", h, (torch.float32,))
    check_shape("h", h, (num_tokens, nr))
    check_contiguous("h", h)
    check_dtype("y", y, FLOAT_DTYPES)
    check_dtype("lora_b", lora_b, (y.dtype,))
    check_shape("lora_b", lora_b, (None, out_features))
    if lora_b.shape[0] % nr:
        raise ValueError(f"lora_b: {lora_b.shape[0]} rows is not a multiple of n * max_rank = {nr}")
    check_contiguous("lora_b", lora_b)
    if y.numel() and y.stride(1) != 1:
        raise ValueError(f"y: last dimension must have stride 1, got strides {y.stride()}")
    _check_slots(token_slots, num_tokens, lora_b.shape[0] // nr)
    check_devices((("h", h), ("lora_b", lora_b), ("token_slots", token_slots), ("y", y)))
    if num_tokens == 0:
        return y
    block_n = 128
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        h,
        lora_b,
        token_slots,
        y,
        out_features,
        y.stride(0),
        NR=nr,
        BLOCK_N=block_n,
        BLOCK_K=min(next_pow2(nr), 32),
    )
    return y
