"""store_kv_cache: scatter this step's K/V rows into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kubeinfer_kernels._common import (
    FLOAT_DTYPES,
    check_devices,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    next_pow2,
)


@triton.jit
def _store_kv_cache_kernel(
    k_ptr,  # [T, num_kv_heads, head_dim]
    v_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T] int64
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    token64 = token.to(tl.int64)
    # Plain copies: no arithmetic, so bf16 is safe under the interpreter too.
    k = tl.load(k_ptr + token64 * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token64 * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
    tl.store(kc + offs_h[:, None] * stride_kc_h + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], v, mask=mask)


def store_kv_cache(
    k: Tensor,  # [T, num_kv_heads, head_dim], may be a strided view of a fused qkv output
    v: Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: Tensor,  # [T] int64, slot = block_id * block_size + offset; -1 = padding, skipped
) -> None:
    """Write k/v row t into cache slot slot_mapping[t]. Slots are not bounds-checked (that would sync)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        check_dtype(name, t, (k_cache.dtype,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    check_devices(
        (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping))
    )
    if num_tokens == 0:
        return
    _store_kv_cache_kernel[(num_tokens,)](
        k_ptr=k,
        v_ptr=v,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        stride_k_t=k.stride(0),
        stride_k_h=k.stride(1),
        stride_v_t=v.stride(0),
        stride_v_h=v.stride(1),
        stride_kc_b=k_cache.stride(0),
        stride_kc_s=k_cache.stride(1),
        stride_kc_h=k_cache.stride(2),
        stride_vc_b=v_cache.stride(0),
        stride_vc_s=v_cache.stride(1),
        stride_vc_h=v_cache.stride(2),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )
