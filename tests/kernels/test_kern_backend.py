"""TritonAttentionBackend (the engine's GPU attention) against the torch backend and the reference."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata

from server.attention.torch_backend import TorchAttentionBackend
from server.attention.triton_backend import TritonAttentionBackend

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64


@pytest.mark.parametrize(
    ("query_lens", "prefix_lens"),
    [
        ([1, 1, 1], [0, 16, 40]),  # pure decode (context 1, block-aligned, ragged)
        ([1, 12, 20, 3], [30, 0, 9, 16]),  # mixed: decode, fresh prefill, chunked prefill, prefix hit
    ],
    ids=["decode", "mixed"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_backend_matches_torch_backend(
    query_lens: list[int], prefix_lens: list[int], dtype: torch.dtype, device: torch.device
) -> None:
    meta = make_attention_metadata(query_lens, prefix_lens, BLOCK_SIZE, device)
    num_tokens = sum(query_lens)
    num_blocks = int(meta.block_tables.max()) + 2
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape).to(dtype).to(device)
    v_cache = torch.randn(cache_shape).to(dtype).to(device)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(dtype).to(device)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype).to(device)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype).to(device)
    scale = HEAD_DIM**-0.5

    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("triton", "torch", "ref")}
    out = TritonAttentionBackend(decode_partition_size=16).forward(q, k, v, *caches["triton"], meta, scale)
    out_torch = TorchAttentionBackend(BLOCK_SIZE).forward(q, k, v, *caches["torch"], meta, scale)
    store_kv_cache_ref(k, v, *caches["ref"], meta.slot_mapping)
    ref = paged_attention_ref(
        q, *caches["ref"], meta.block_tables, meta.context_lens, meta.query_start_loc, scale
    )

    for name in ("triton", "torch"):
        assert torch.equal(caches[name][0], caches["ref"][0]) and torch.equal(
            caches[name][1], caches["ref"][1]
        )
    atol, rtol = ATTN_TOL[dtype]
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float(), out_torch.float(), atol=atol, rtol=rtol)
