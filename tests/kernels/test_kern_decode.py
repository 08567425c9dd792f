"""paged_attention_decode against the torch reference, single-pass and split-K."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import paged_attention_decode
from kubeinfer_kernels.reference import paged_attention_decode_ref
from paged_batch import ATTN_TOL, PagedBatch, make_paged_batch

NUM_KV_HEADS = 2


def _contexts(block_size: int) -> list[int]:
    # 1 token, an exact multiple of the block size, a ragged multi-block one, a short ragged one.
    return [1, 2 * block_size, 3 * block_size + 5, 45]


def _check(batch: PagedBatch, out: torch.Tensor, scale: float) -> None:
    ref = paged_attention_decode_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale
    )
    atol, rtol = ATTN_TOL[batch.q.dtype]
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("partition_size", [512, 32], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(
    block_size: int, head_dim: int, gqa: int, partition_size: int, device: torch.device
) -> None:
    ctx = _contexts(block_size)
    batch = make_paged_batch(
        [1] * len(ctx),
        ctx,
        num_heads=NUM_KV_HEADS * gqa,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
    )
    scale = head_dim**-0.5
    out = paged_attention_decode(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        scale,
        max_context_len=batch.max_context_len,
        partition_size=partition_size,
    )
    _check(batch, out, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_16bit_split_k(dtype: torch.dtype, device: torch.device) -> None:
    batch = make_paged_batch(
        [1, 1, 1], [1, 40, 77], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype, device=device,
    )  # fmt: skip
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
        max_context_len=batch.max_context_len, partition_size=16,
    )  # fmt: skip
    _check(batch, out, 0.125)


def test_decode_many_partitions_and_peaked_softmax(device: torch.device) -> None:
    # 45 partitions (more than one reduction chunk of 32) and large logits, so the partitions' maxima
    # differ by far more than exp can absorb without the log-sum-exp rescaling.
    batch = make_paged_batch(
        [1, 1], [720, 33], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32, device=device, q_scale=6.0,
    )  # fmt: skip
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.5,
        max_context_len=batch.max_context_len, partition_size=16,
    )  # fmt: skip
    _check(batch, out, 0.5)


def test_decode_head_dim_not_a_power_of_two(device: torch.device) -> None:
    # head_dim 80 (Phi-2 style) is padded to a 128-wide tile and masked.
    batch = make_paged_batch(
        [1, 1], [19, 50], num_heads=4, num_kv_heads=2, head_dim=80, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 80**-0.5,
        max_context_len=batch.max_context_len, partition_size=32,
    )  # fmt: skip
    _check(batch, out, 80**-0.5)


def test_decode_max_context_len_above_actual(device: torch.device) -> None:
    # A grid sized for a longer context than any sequence has: the extra programs must write nothing.
    batch = make_paged_batch(
        [1, 1], [5, 20], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    for partition_size in (16, 512):
        out = paged_attention_decode(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
            max_context_len=100, partition_size=partition_size,
        )  # fmt: skip
        _check(batch, out, 0.125)


def test_decode_strided_query_view(device: torch.device) -> None:
    # q sliced out of a fused qkv projection: rows are not contiguous.
    batch = make_paged_batch(
        [1, 1], [9, 30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    fused = torch.randn(2, 8, 64, device=device)
    fused[:, :4] = batch.q
    q = fused[:, :4]
    assert not q.is_contiguous()
    out = paged_attention_decode(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
        max_context_len=batch.max_context_len, partition_size=16,
    )  # fmt: skip
    _check(batch, out, 0.125)


def test_decode_rejects_bad_arguments(device: torch.device) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    with pytest.raises(TypeError, match="q"):
        paged_attention_decode(batch.q.half(), *args, max_context_len=5)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_decode(batch.q[:, :3], *args, max_context_len=5)
    with pytest.raises(ValueError, match="partition_size"):
        paged_attention_decode(batch.q, *args, max_context_len=5, partition_size=48)
    with pytest.raises(TypeError, match="block_tables"):
        paged_attention_decode(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables.long(), batch.context_lens, 0.125,
            max_context_len=5,
        )  # fmt: skip
    with pytest.raises(ValueError, match="rows"):
        paged_attention_decode(torch.cat([batch.q, batch.q]), *args, max_context_len=5)
