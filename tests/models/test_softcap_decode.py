"""cpu_fused.cpp's softcap_paged_decode (Gemma 2's soft-capped scores in one-token paged decode, the decode
graph's kernel for these layers) against the torch reference (kubeinfer_kernels.reference) and the
attention library's decode kernel with the same soft-cap: GQA, scattered blocks, an fp32, bf16 or fp16
cache, with and without a window shorter than the contexts."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref

from server.attention import AttentionMetadata
from server.attention.cpu_kernel import load_decode_kernel
from server.models.cpu_fused import FusedOps, load_fused_ops

HQ, HKV, D, BLOCK = 4, 2, 16, 4
CONTEXTS = [1, 7, 13, 22]  # one per decode row; 1: the query attends to its own key only


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    return load_fused_ops()


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
    ops: FusedOps, cache_dtype: torch.dtype, window: int | None
) -> None:
    q, k, v, k_cache, v_cache, tables, ctx, slots = _decode_batch(cache_dtype)
    meta = _meta(tables, ctx, slots)
    scale, cap = D**-0.5, 2.0
    # k/v stored (rounded to the cache's dtype) as a backend stores them; the reference attends in fp32
    k_cache.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, k.to(cache_dtype))
    v_cache.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, v.to(cache_dtype))
    args = (q, k_cache.float(), v_cache.float(), tables, ctx, scale, window)
    want = paged_attention_decode_ref(*args, softcap=cap)
    got = ops.softcap_paged_decode(q, k_cache, v_cache, tables, ctx, scale, cap, window)
    # fp32 sums in another order: ~1e-6 on outputs of magnitude ~1
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the attention library's decode kernel (the backends' path) with the same soft-cap agrees
    lib = torch.empty_like(q)
    rows = torch.arange(len(CONTEXTS), dtype=torch.int64)
    load_decode_kernel()(
        lib, q, k_cache, v_cache, tables, ctx, rows, rows, scale, sliding_window=window, softcap=cap
    )
    torch.testing.assert_close(lib, got, atol=2e-5, rtol=1e-5)
    # the cap matters here: without it the result is another
    assert (paged_attention_decode_ref(*args) - got).abs().max() > 1e-2


def test_bad_operands_raise(ops: FusedOps) -> None:
    q, _, _, k_cache, v_cache, tables, ctx, _ = _decode_batch(torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        ops.softcap_paged_decode(q, k_cache, v_cache, tables, ctx, 0.25, 0.0)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.softcap_paged_decode(q, k_cache, v_cache, tables, ctx, 0.25, 2.0, 0)
    with pytest.raises(TypeError, match="q must be"):
        ops.softcap_paged_decode(q.double(), k_cache, v_cache, tables, ctx, 0.25, 2.0)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]  # a block past the cache
    with pytest.raises(ValueError):
        ops.softcap_paged_decode(q, k_cache, v_cache, bad, ctx, 0.25, 2.0)
