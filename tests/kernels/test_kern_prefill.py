"""paged_prefill_attention against the torch reference: varlen chunks, with and without cached prefixes."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import paged_attention_decode, paged_prefill_attention
from kubeinfer_kernels.reference import paged_attention_ref
from paged_batch import ATTN_TOL, PagedBatch, make_paged_batch

NUM_KV_HEADS = 2


def _run(batch: PagedBatch, scale: float, q: torch.Tensor | None = None) -> torch.Tensor:
    return paged_prefill_attention(
        batch.q if q is None else q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        scale,
        max_query_len=batch.max_query_len,
    )


def _check(batch: PagedBatch, out: torch.Tensor, scale: float) -> None:
    ref = paged_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
        batch.query_start_loc, scale,
    )  # fmt: skip
    atol, rtol = ATTN_TOL[batch.q.dtype]
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _lengths(block_size: int, prefix: str) -> tuple[list[int], list[int]]:
    query_lens = [1, 37, 5]
    if prefix == "no-prefix":  # plain prefill; the 1-token prompt is a context of 1
        prefixes = [0, 0, 0]
    else:  # chunked prefill / prefix-cache hits: a block-aligned prefix and two ragged ones
        prefixes = [block_size + 3, 2 * block_size, 7]
    return query_lens, [q + p for q, p in zip(query_lens, prefixes, strict=True)]


@pytest.mark.parametrize("prefix", ["no-prefix", "cached-prefix"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(
    block_size: int, head_dim: int, gqa: int, prefix: str, device: torch.device
) -> None:
    query_lens, context_lens = _lengths(block_size, prefix)
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_heads=NUM_KV_HEADS * gqa,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
    )
    scale = head_dim**-0.5
    _check(batch, _run(batch, scale), scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_16bit(dtype: torch.dtype, device: torch.device) -> None:
    batch = make_paged_batch(
        [20, 3], [20, 50], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype, device=device,
    )  # fmt: skip
    _check(batch, _run(batch, 0.125), 0.125)


def test_prefill_chunk_longer_than_one_tile(device: torch.device) -> None:
    # 100 new tokens span two 64-row query tiles; the second tile's causal window starts mid-chunk.
    batch = make_paged_batch(
        [100, 2], [117, 2], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32, device=device, q_scale=4.0,
    )  # fmt: skip
    _check(batch, _run(batch, 0.125), 0.125)


def test_prefill_head_dim_not_a_power_of_two(device: torch.device) -> None:
    batch = make_paged_batch(
        [7, 18], [7, 30], num_heads=4, num_kv_heads=2, head_dim=80, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    _check(batch, _run(batch, 80**-0.5), 80**-0.5)


def test_prefill_of_single_tokens_equals_decode(device: torch.device) -> None:
    batch = make_paged_batch(
        [1, 1, 1], [1, 16, 39], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    prefill = _run(batch, 0.125)
    decode = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
        max_context_len=batch.max_context_len, partition_size=16,
    )  # fmt: skip
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


def test_prefill_strided_query_view(device: torch.device) -> None:
    batch = make_paged_batch(
        [6, 9], [6, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    fused = torch.randn(15, 8, 64, device=device)
    fused[:, 2:6] = batch.q
    q = fused[:, 2:6]
    assert not q.is_contiguous()
    _check(batch, _run(batch, 0.125, q=q), 0.125)


def test_prefill_rejects_bad_arguments(device: torch.device) -> None:
    batch = make_paged_batch(
        [3], [3], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
            batch.query_start_loc[:1], 0.125, max_query_len=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="v_cache"):
        paged_prefill_attention(
            batch.q, batch.k_cache, batch.v_cache[:, :8], batch.block_tables, batch.context_lens,
            batch.query_start_loc, 0.125, max_query_len=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="stride 1"):
        paged_prefill_attention(
            batch.q.transpose(1, 2).contiguous().transpose(1, 2), batch.k_cache, batch.v_cache,
            batch.block_tables, batch.context_lens, batch.query_start_loc, 0.125, max_query_len=3,
        )  # fmt: skip
