"""paged_prefill_attention: varlen query chunks over the paged KV cache (chunked prefill, prefix hits).

Each sequence's new tokens sit at the end of its context: with q_len new tokens and context_len keys,
new token i has position prefix + i (prefix = context_len - q_len) and sees keys 0..prefix + i. The
new tokens' K/V are read from the cache (store_kv_cache runs first), so prefix and chunk are one
causal range. Grid: query tile x sequence x query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kubeinfer_kernels._common import (
    LOG2E,
    check_contiguous,
    check_devices,
    check_dtype,
    check_paged_attention_args,
    check_shape,
    dot_precision,
    next_pow2,
    sinks_arg,
    softcap_arg,
    tanh_cap,
    upcast_loads,
    window_arg,
)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [T, num_heads, head_dim]
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window W (NO_WINDOW: none): the query at position p sees keys p - W + 1 .. p
    sinks_ptr,  # [num_heads] fp32 attention sinks, natural-log units (read only when HAS_SINKS)
    softcap_log2,  # the attention logit soft-cap * log2(e) (read only when HAS_SOFTCAP)
    stride_q_t,
    stride_q_h,
    stride_c_b,
    stride_c_s,
    stride_c_h,
    stride_bt_s,
    stride_o_t,
    stride_o_h,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # grid is sized for the longest chunk
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m  # [BLOCK_M]
    # Keys past the tile's last query are invisible to all of its rows.
    kv_end = tl.minimum(ctx, prefix + (m_block + 1) * BLOCK_M)
    # Keys before the tile's first query's window are invisible to all of its rows.
    kv_start = tl.maximum(0, prefix + m_block * BLOCK_M - window + 1)

    seq64 = seq.to(tl.int64)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block = tl.load(block_tables_ptr + seq64 * stride_bt_s + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        row = block.to(tl.int64) * stride_c_b + (offs_n % BLOCK_SIZE) * stride_c_s + kv_head * stride_c_h
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:  # Gemma 2: cap * tanh(s / cap) before the mask, in log2 units as s
            s = tanh_cap(s, softcap_log2)
        visible = (
            (offs_n[None, :] <= q_pos[:, None])
            & (offs_n[None, :] > q_pos[:, None] - window)
            & n_mask[None, :]
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Every stored row sees its own key, so l_i > 0 there; the guard only keeps masked rows NaN-free. A row
    # whose first blocks are all before its window keeps m = -1e30 over them: exp2(-inf + 1e30) adds 0.
    if HAS_SINKS:
        # the head's sink joins every row's denominator under max(m, sink) (exp2 units): no overflow
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_s = tl.maximum(m_i, sink)
        corr = tl.exp2(m_i - m_s)
        acc = acc * corr[:, None]
        l_i = l_i * corr + tl.exp2(sink - m_s)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: Tensor,  # [T, num_heads, head_dim], new tokens of all sequences concatenated (varlen)
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], already holding the new tokens
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32, KV length including the new tokens
    query_start_loc: Tensor,  # [num_seqs + 1] int32, offsets of each sequence's new tokens in T
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,  # [num_heads] fp32 on q's device
    softcap: float = 0.0,
) -> Tensor:  # [T, num_heads, head_dim] in q.dtype; rows outside every sequence are left unwritten
    """Causal inside each chunk, full over the sequence's cached prefix. `max_query_len` (host int, no
    sync) sizes the grid and must be >= every chunk length. `sliding_window` W: the query at position p
    sees keys p - W + 1 .. p only (transformers' sliding_window_overlay, kv_idx > q_idx - W), in the
    chunk and in the prefix alike. ValueError for W < 1. `sinks`: gpt-oss's attention sinks, one logit
    per query head joining each softmax's denominator (`sinks_arg`). `softcap`: 0, or the attention
    logit soft-cap: scaled scores cap * tanh(s / cap) before the mask (Gemma 2; `softcap_arg`:
    ValueError for a negative or non-finite cap)."""
    window = window_arg(sliding_window)
    softcap_log2 = softcap_arg(softcap)
    check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    sinks_t = sinks_arg(sinks, q)
    num_seqs = block_tables.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check_contiguous("query_start_loc", query_start_loc)
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    device = check_devices(
        (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
         ("context_lens", context_lens), ("query_start_loc", query_start_loc))
    )  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    block_m = min(64, max(16, next_pow2(max_query_len)))
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, num_heads)](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        context_lens_ptr=context_lens,
        query_start_loc_ptr=query_start_loc,
        out_ptr=out,
        scale_log2=scale * LOG2E,
        window=window,
        sinks_ptr=sinks_t,
        softcap_log2=softcap_log2,
        stride_q_t=q.stride(0),
        stride_q_h=q.stride(1),
        stride_c_b=k_cache.stride(0),
        stride_c_s=k_cache.stride(1),
        stride_c_h=k_cache.stride(2),
        stride_bt_s=block_tables.stride(0),
        stride_o_t=out.stride(0),
        stride_o_h=out.stride(1),
        head_dim=head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=max(16, next_pow2(head_dim)),
        UPCAST=upcast_loads(q.dtype),
        PRECISION=dot_precision(q.dtype),
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=softcap_log2 > 0,
    )
    return out
