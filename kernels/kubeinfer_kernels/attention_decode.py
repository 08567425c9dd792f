"""paged_attention_decode: one query token per sequence over the paged KV cache, split-K.

Pass 1 (grid: seq x kv head x partition): each program takes one `partition_size` slice of one
sequence's context for all query heads sharing a KV head (GQA rows of one tl.dot), and writes an
unnormalised partial output plus its running max and sum. Pass 2 (grid: seq x head) merges the
partitions with the usual log-sum-exp rescaling. When every context fits one partition, pass 1 writes
the normalised output directly and pass 2 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kubeinfer_kernels._common import (
    LOG2E,
    check_devices,
    check_paged_attention_args,
    dot_precision,
    next_pow2,
    sinks_arg,
    softcap_arg,
    tanh_cap,
    upcast_loads,
    window_arg,
)

# Large enough that one partition amortises its launch, small enough that a 4k context spans 8 programs.
DEFAULT_PARTITION_SIZE = 512


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim], written only when SINGLE_PARTITION
    part_acc_ptr,  # [num_seqs, num_heads, max_partitions, head_dim] fp32, unnormalised
    part_max_ptr,  # [num_seqs, num_heads, max_partitions] fp32, running max in log2 units
    part_sum_ptr,  # [num_seqs, num_heads, max_partitions] fp32
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    window,  # sliding window W (NO_WINDOW: none): the query at position ctx - 1 sees keys ctx - W .. ctx - 1
    sinks_ptr,  # [num_heads] fp32 attention sinks, natural-log units (read only when HAS_SINKS)
    softcap_log2,  # the attention logit soft-cap * log2(e) (read only when HAS_SOFTCAP)
    stride_q_s,
    stride_q_h,
    stride_c_b,
    stride_c_s,
    stride_c_h,
    stride_bt_s,
    stride_o_s,
    stride_o_h,
    max_partitions,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # cache block size
    PARTITION_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = part * PARTITION_SIZE
    # The grid is sized for the longest context; partition 0 always runs so an empty context writes zeros.
    if start >= tl.maximum(ctx, 1):
        return
    end = tl.minimum(start + PARTITION_SIZE, ctx)
    # A partition wholly before the window runs no iteration and leaves m = -1e30, l = 0: weight 0 when merged.
    lo = tl.maximum(start, ctx - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64 * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # -1e30 rather than -inf keeps exp2(m_old - m_new) finite for rows that see no key yet.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(block_tables_ptr + seq64 * stride_bt_s + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        row = block.to(tl.int64) * stride_c_b + (offs_n % BLOCK_SIZE) * stride_c_s + kv_head * stride_c_h
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:  # Gemma 2: cap * tanh(s / cap) before the mask, in log2 units as s
            s = tanh_cap(s, softcap_log2)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_PARTITION:
        if HAS_SINKS:
            # the sink joins the denominator under max(m, sink) (exp2 units), so neither term overflows
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634
            m_s = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_s)
            acc = acc * corr[:, None]
            l_i = l_i * corr + tl.exp2(sink - m_s)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq64 * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        stat = (seq64 * GROUP * tl.num_programs(1) + heads) * max_partitions + part  # [BLOCK_G]
        tl.store(part_max_ptr + stat, m_i, mask=g_mask)
        tl.store(part_sum_ptr + stat, l_i, mask=g_mask)
        tl.store(part_acc_ptr + stat[:, None] * head_dim + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    part_acc_ptr,  # [num_seqs, num_heads, max_partitions, head_dim] fp32
    part_max_ptr,  # [num_seqs, num_heads, max_partitions] fp32
    part_sum_ptr,  # [num_seqs, num_heads, max_partitions] fp32
    context_lens_ptr,  # [num_seqs] int32
    sinks_ptr,  # [num_heads] fp32 attention sinks, natural-log units (read only when HAS_SINKS)
    stride_o_s,
    stride_o_h,
    max_partitions,
    head_dim,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    num_parts = tl.cdiv(ctx, PARTITION_SIZE)
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * max_partitions
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    m_run = tl.full([BLOCK_P], -1.0e30, dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        m = tl.load(part_max_ptr + base + offs_p, mask=offs_p < num_parts, other=-1.0e30)
        m_run = tl.maximum(m_run, m)
    m_all = tl.max(m_run, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 units, as the partitions' maxima
        m_all = tl.maximum(m_all, sink)

    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_P], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < num_parts
        m = tl.load(part_max_ptr + base + offs_p, mask=p_mask, other=-1.0e30)
        w = tl.where(p_mask, tl.exp2(m - m_all), 0.0)
        den += w * tl.load(part_sum_ptr + base + offs_p, mask=p_mask, other=0.0)
        a = tl.load(
            part_acc_ptr + (base + offs_p)[:, None] * head_dim + offs_d[None, :],
            mask=p_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, None] * a, axis=0)
    total = tl.sum(den, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_all)
    total = tl.where(total > 0.0, total, 1.0)  # empty context (ctx == 0) yields zeros, not NaN
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_o_s + head * stride_o_h + offs_d,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def paged_attention_decode(
    q: Tensor,  # [num_seqs, num_heads, head_dim], the one new token of each sequence
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], already holding the new token
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32, KV length including the new token
    scale: float,
    max_context_len: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,  # [num_heads] fp32 on q's device
    softcap: float = 0.0,
) -> Tensor:  # [num_seqs, num_heads, head_dim] in q.dtype
    """Decode attention. `max_context_len` (a host int, so no device sync) sizes the split-K grid and
    must be >= every context length; block tables must cover each context. `sliding_window` W: each
    query (position context_len - 1) sees its last W keys only (transformers' sliding_window_overlay,
    kv_idx > q_idx - W); blocks before that are not read. ValueError for W < 1. `sinks`: gpt-oss's
    attention sinks, one logit per query head joining each softmax's denominator (`sinks_arg`).
    `softcap`: 0, or the attention logit soft-cap: scaled scores cap * tanh(s / cap) before the softmax
    (Gemma 2; `softcap_arg`: ValueError for a negative or non-finite cap)."""
    window = window_arg(sliding_window)
    softcap_log2 = softcap_arg(softcap)
    check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    sinks_t = sinks_arg(sinks, q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if max_context_len < 0:
        raise ValueError(f"max_context_len must be >= 0, got {max_context_len}")
    device = check_devices(
        (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
         ("context_lens", context_lens))
    )  # fmt: skip
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0:
        return out
    if max_context_len == 0:
        return out.zero_()
    group = num_heads // num_kv_heads
    max_partitions = triton.cdiv(max_context_len, partition_size)
    single = max_partitions == 1
    # One fp32 scratch set per call: partial outputs are tiny next to the KV they summarise.
    scratch = 0 if single else max_partitions
    part_acc = torch.empty((num_seqs, num_heads, scratch, head_dim), dtype=torch.float32, device=device)
    part_max = torch.empty((num_seqs, num_heads, scratch), dtype=torch.float32, device=device)
    part_sum = torch.empty((num_seqs, num_heads, scratch), dtype=torch.float32, device=device)
    block_d = max(16, next_pow2(head_dim))
    _decode_partition_kernel[(num_seqs, num_kv_heads, max_partitions)](
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        context_lens_ptr=context_lens,
        out_ptr=out,
        part_acc_ptr=part_acc,
        part_max_ptr=part_max,
        part_sum_ptr=part_sum,
        scale_log2=scale * LOG2E,
        window=window,
        sinks_ptr=sinks_t,
        softcap_log2=softcap_log2,
        stride_q_s=q.stride(0),
        stride_q_h=q.stride(1),
        stride_c_b=k_cache.stride(0),
        stride_c_s=k_cache.stride(1),
        stride_c_h=k_cache.stride(2),
        stride_bt_s=block_tables.stride(0),
        stride_o_s=out.stride(0),
        stride_o_h=out.stride(1),
        max_partitions=max_partitions,
        head_dim=head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=partition_size,
        BLOCK_G=max(16, next_pow2(group)),  # tl.dot needs >= 16 rows on GPUs
        BLOCK_N=min(64, partition_size),
        BLOCK_D=block_d,
        SINGLE_PARTITION=single,
        UPCAST=upcast_loads(q.dtype),
        PRECISION=dot_precision(q.dtype),
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=softcap_log2 > 0,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out_ptr=out,
            part_acc_ptr=part_acc,
            part_max_ptr=part_max,
            part_sum_ptr=part_sum,
            context_lens_ptr=context_lens,
            sinks_ptr=sinks_t,
            stride_o_s=out.stride(0),
            stride_o_h=out.stride(1),
            max_partitions=max_partitions,
            head_dim=head_dim,
            PARTITION_SIZE=partition_size,
            BLOCK_P=min(32, next_pow2(max_partitions)),
            BLOCK_D=block_d,
            HAS_SINKS=sinks is not None,
        )
    return out
