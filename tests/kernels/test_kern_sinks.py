"""Attention sinks (gpt-oss: one learned logit per query head joining every softmax's denominator) in the
Triton kernels (decode single-pass and split-K, varlen prefill) and the Triton backend, alone and with a
sliding window, against the torch reference (transformers' concatenated sink column)."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import paged_attention_decode, paged_prefill_attention
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch

from server.attention.triton_backend import TritonAttentionBackend


def _sinks(num_heads: int, device: torch.device) -> torch.Tensor:
    # ordinary values, plus one far above every score (output ~0: overflow-safe merge) and one far below
    s = torch.randn(num_heads) * 2
    s[0], s[-1] = 40.0, -40.0
    return s.to(device)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("partition_size", [512, 16], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_sinks_match_reference(
    window: int | None, partition_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    ctx = [1, 30, 77, 45]
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        device=device,
    )  # fmt: skip
    sinks = _sinks(8, device)
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
        max_context_len=batch.max_context_len, partition_size=partition_size, sliding_window=window,
        sinks=sinks,
    )  # fmt: skip
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125, window)
    ref = paged_attention_decode_ref(*args, sinks=sinks)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    # the sinks change the answer well beyond the tolerance: a kernel ignoring them fails above
    assert (paged_attention_decode_ref(*args).float() - ref.float()).abs().max() > 0.2


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_sinks_match_reference(window: int | None, dtype: torch.dtype, device: torch.device) -> None:
    # a whole prompt of 3 query tiles, a chunk over a cached prefix, a 1-token chunk, a short prompt
    query_lens, ctx_lens = [150, 37, 1, 5], [150, 100, 60, 5]
    batch = make_paged_batch(
        query_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        device=device,
    )  # fmt: skip
    sinks = _sinks(4, device)
    out = paged_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
        0.125, max_query_len=batch.max_query_len, sliding_window=window, sinks=sinks,
    )  # fmt: skip
    args = (
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
        0.125, window,
    )  # fmt: skip
    ref = paged_attention_ref(*args, sinks=sinks)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert (paged_attention_ref(*args).float() - ref.float()).abs().max() > 0.2


def test_launchers_refuse_bad_sinks(device: torch.device) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    for bad, err in (
        (torch.zeros(3, device=device), ValueError),
        (torch.zeros(2, dtype=torch.float16, device=device), TypeError),
    ):
        with pytest.raises(err, match="sinks"):
            paged_attention_decode(
                batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
                max_context_len=5, sinks=bad,
            )  # fmt: skip
        with pytest.raises(err, match="sinks"):
            paged_prefill_attention(
                batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                batch.query_start_loc, 0.125, max_query_len=1, sinks=bad,
            )  # fmt: skip


def test_triton_backend_sinks_with_and_without_windows(device: torch.device) -> None:
    """gpt-oss's layers alternate a window (with sinks) and full attention (with sinks): one step's
    metadata through both, decode and mixed batches."""
    for query_lens, prefix_lens in (([1, 1, 1], [0, 40, 70]), ([1, 30, 9, 1], [50, 0, 40, 20])):
        # decode only (the decode kernel), then mixed (the prefill kernel)
        meta = make_attention_metadata(query_lens, prefix_lens, 16, device)
        t = sum(query_lens)
        shape = (int(meta.block_tables.max()) + 2, 16, 2, 64)
        k_cache, v_cache = torch.randn(shape, device=device), torch.randn(shape, device=device)
        backend = TritonAttentionBackend(decode_partition_size=16)
        for window in (16, None):
            sinks = _sinks(8, device)
            q = torch.randn(t, 8, 64, device=device)
            k, v = torch.randn(t, 2, 64, device=device), torch.randn(t, 2, 64, device=device)
            kc, vc = k_cache.clone(), v_cache.clone()
            out = backend.forward(q, k, v, kc, vc, meta, 0.125, sliding_window=window, sinks=sinks)
            rk, rv = k_cache.clone(), v_cache.clone()
            store_kv_cache_ref(k, v, rk, rv, meta.slot_mapping)
            ref = paged_attention_ref(
                q, rk, rv, meta.block_tables, meta.context_lens, meta.query_start_loc, 0.125,
                sliding_window=window, sinks=sinks,
            )  # fmt: skip
            atol, rtol = ATTN_TOL[torch.float32]
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=f"window {window}")
