"""Attention backend on the Triton kernels (kernels/): the GPU path of the paged KV cache.

Per layer: store this step's K/V at their slots (store_kv_cache), then attend. A pure-decode batch
(one new token per sequence) takes the split-K decode kernel; anything else (prefill chunks, prefix
hits, mixed batches) takes the varlen prefill kernel, which is causal inside each chunk and full over
the cached prefix. On a machine without CUDA, importing `kernels` switches Triton to its interpreter,
so this backend also runs (slowly) on CPU for parity tests.
"""

from __future__ import annotations

import torch
from kubeinfer_kernels import paged_attention_decode, paged_prefill_attention, store_kv_cache
from kubeinfer_kernels.attention_decode import DEFAULT_PARTITION_SIZE
from torch import Tensor

from server.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE) -> None:
        # Tokens per split-K program in decode; a power of two >= 16 (checked by the kernel launcher).
        self.decode_partition_size = decode_partition_size

    def forward(
        self,
        q: Tensor,  # [T, num_heads, head_dim]
        k: Tensor,  # [T, num_kv_heads, head_dim]
        v: Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], updated in place
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], updated in place
        meta: AttentionMetadata,
        scale: float,
        out_dtype: torch.dtype | None = None,  # ignored: q's dtype throughout (AttentionBackend)
        sliding_window: int | None = None,  # this layer's window W: keys p - W + 1 .. p (AttentionBackend)
        sinks: Tensor | None = None,  # [num_heads] fp32 on q's device: attention sinks (AttentionBackend)
        softcap: float = 0.0,  # 0, or the layer's attention logit soft-cap (AttentionBackend)
    ) -> Tensor:  # [T, num_heads, head_dim] in q.dtype
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        num_seqs = meta.block_tables.shape[0]
        # With one token per sequence the rows of q are the sequences themselves (no padding rows).
        if meta.max_query_len == 1 and q.shape[0] == num_seqs:
            return paged_attention_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                max_context_len=meta.max_context_len,
                partition_size=self.decode_partition_size,
                sliding_window=sliding_window,
                sinks=sinks,
                softcap=softcap,
            )
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            scale,
            max_query_len=meta.max_query_len,
            sliding_window=sliding_window,
            sinks=sinks,
            softcap=softcap,
        )
