"""The attention library's decode kernel with Gemma 2's soft-cap (`kubeinfer_paged_decode_capped`, the decode
graph's attention for every layer and the fused path's through the backend) as those two call it: q and
out as views into wider rows (row strides), GQA, scattered blocks, an fp32, bf16 or fp16 cache, with and
without a window shorter than the contexts, against the torch reference (kubeinfer_kernels.reference,
transformers' eager Gemma 2 attention)."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref

from server.attention import AttentionMetadata
from server.attention.cpu_kernel import DecodeKernel, load_decode_kernel

HQ, HKV, D, BLOCK = 4, 2, 16, 4
CONTEXTS = [1, 7, 13, 22]  # one per decode row; 1: the query attends to its own key only


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    return load_decode_kernel()


def _decode_batch(cache_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    num_blocks = 32
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=g).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=g)  # scattered blocks, as a paged cache holds them
    max_blocks = -(-max(CONTEXTS) // BLOCK)
    tables = perm[: len(CONTEXTS) * max_blocks].view(len(CONTEXTS), max_blocks).to(torch.int32)
    ctx = torch.tensor(CONTEXTS, dtype=torch.int32)
    pos = ctx.long() - 1  # each row's new token
    slots = tables.long()[torch.arange(len(CONTEXTS)), pos // BLOCK] * BLOCK + pos % BLOCK
    # q as a view into a fused qkv row (row stride (Hq + 2 Hkv) D), as the fused path hands it over
    qkv = torch.randn(len(CONTEXTS), (HQ + 2 * HKV) * D, generator=g) * 3  # large scores: the cap bends them
    q = qkv[:, : HQ * D].view(-1, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(-1, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(-1, HKV, D)
    return q, k, v, k_cache, v_cache, tables, ctx, slots


def _meta(tables: torch.Tensor, ctx: torch.Tensor, slots: torch.Tensor) -> AttentionMetadata:
    n = len(CONTEXTS)
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=ctx,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        max_query_len=1,
        max_context_len=max(CONTEXTS),
        query_lens_cpu=(1,) * n,
        context_lens_cpu=tuple(CONTEXTS),
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_the_torch_reference(
    kernel: DecodeKernel, cache_dtype: torch.dtype, window: int | None
) -> None:
    q, k, v, k_cache, v_cache, tables, ctx, slots = _decode_batch(cache_dtype)
    meta = _meta(tables, ctx, slots)
    scale, cap = D**-0.5, 2.0
    # k/v stored (rounded to the cache's dtype) as a backend stores them; the reference attends in fp32
    k_cache.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, k.to(cache_dtype))
    v_cache.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, v.to(cache_dtype))
    args = (q, k_cache.float(), v_cache.float(), tables, ctx, scale, window)
    want = paged_attention_decode_ref(*args, softcap=cap)
    # out as a view into wider rows too (the graph's attention buffer has its own row stride)
    out_rows = torch.full((len(CONTEXTS), (HQ + 1) * D), float("nan"))
    got = out_rows[:, : HQ * D].view(-1, HQ, D)
    rows = torch.arange(len(CONTEXTS), dtype=torch.int64)
    kernel(got, q, k_cache, v_cache, tables, ctx, rows, rows, scale, sliding_window=window, softcap=cap)
    # fp32 sums in another order: ~1e-6 on outputs of magnitude ~1
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert out_rows[:, HQ * D :].isnan().all()  # nothing written past each row's heads
    # the cap matters here: without it the result is another
    assert (paged_attention_decode_ref(*args) - got).abs().max() > 1e-2
