"""Attention for a decoder embedder's batch over each row's real tokens only, without the padding.

`DenseBatchAttention` (dense_attention.py) scatters a batch's packed tokens into a padded `[B, H, S, S]` problem
and runs one masked SDPA: on a CPU that is the slow kind of SDPA call (a boolean mask, heads grouped by
GQA, rows padded to the longest), and for 16 texts of 8-40 words it was 27% of a Qwen3-Embedding-0.6B
step (5.9 ms a layer for 0.3 GFLOP; docs/benchmarks-log.md, "Decoder embedders' attention without the
padding"). `PackedRowsAttention` is the backend `DecoderEncoder` hands the layers instead:

- bf16 attention (`kernel` given: the model multiplies in bf16, `--dtype auto` on a CPU with native bf16
  or `--dtype bfloat16`): every causal layer, windows, sinks and soft-caps included, is one call of the
  compiled prefill kernel (server/attention/csrc/paged_decode.cpp, `kubeinfer_paged_prefill`: bf16
  products, fp32 sums and online softmax, the products vLLM's bf16 attention makes) over K/V laid per row
  into 16-token blocks, each row a sequence of its own: no product touches padding. 0.53 ms a layer for
  that batch.
- otherwise (fp32, no usable kernel, or a bidirectional model): one unmasked SDPA per row (causal, or
  bidirectional for EmbeddingGemma) where the layer's window does not reach inside the longest row and it
  has no sinks or soft-cap (2.2 ms); the dense masked pass for the rest.

The rows' tokens are what `DecoderEncoder` packs: the real tokens of a `[B, S]` grid in row-major order,
each row's in order, its positions counting its own real tokens from 0 (padding on either side).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from server.attention import AttentionMetadata
from server.attention.cpu_kernel import DecodeKernel, PrefillChunks, check_softcap, check_window

from .dense_attention import DenseBatchAttention

log = logging.getLogger(__name__)

BLOCK_SIZE = 16  # tokens per block of the rows' K/V copy the prefill kernel reads


class PackedRowsAttention:
    """An attention backend (server/attention/backend.py's protocol) for one padded batch, row by row over
    the packed real tokens. The caches and metadata it is handed are ignored."""

    name = "packed-rows"

    def __init__(
        self,
        real: Tensor,  # [B, S] bool, a real token
        positions: Tensor,  # [B, S] int64, each real token's position in its row (0 .. n - 1)
        bidirectional: bool,
        kernel: DecodeKernel | None = None,  # the compiled prefill kernel: bf16 attention of causal rows
    ) -> None:
        self._real, self._positions, self._bidirectional = real, positions, bidirectional
        self._dense: DenseBatchAttention | None = None
        lens = real.sum(dim=1)  # [B]
        self._lens: list[int] = lens.tolist()
        starts = lens.cumsum(0) - lens
        self._starts: list[int] = starts.tolist()
        self._longest = max(self._lens, default=0)
        self._kernel = kernel if not bidirectional else None
        if self._kernel is not None:
            rows = lens > 0  # a row without real tokens has nothing to attend
            row_lens, row_starts = lens[rows], starts[rows]
            blocks = (row_lens + BLOCK_SIZE - 1) // BLOCK_SIZE  # [R]
            first = blocks.cumsum(0) - blocks  # [R] each row's first block
            width = int(blocks.max()) if blocks.numel() else 1
            cols = torch.arange(width)
            tables = first[:, None] + cols[None, :]  # [R, width]
            self._tables = torch.where(cols[None, :] < blocks[:, None], tables, 0).to(torch.int32)
            self._num_blocks = int(blocks.sum())
            # each packed token's slot: its row's first block, then its place in the row
            row_of = torch.repeat_interleave(torch.arange(row_lens.numel()), row_lens)  # [T]
            place = torch.arange(int(row_lens.sum())) - torch.repeat_interleave(row_starts, row_lens)
            self._slots = first[row_of] * BLOCK_SIZE + place  # [T] int64
            n32 = row_lens.to(torch.int32)
            self._chunks = PrefillChunks(torch.arange(row_lens.numel()), row_starts.contiguous(), n32, n32)

    def _dense_backend(self) -> DenseBatchAttention:
        if self._dense is None:
            self._dense = DenseBatchAttention(self._real, self._positions, self._bidirectional)
        return self._dense

    def forward(
        self,
        q: Tensor,  # [T, num_heads, head_dim]
        k: Tensor,  # [T, num_kv_heads, head_dim]
        v: Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        out_dtype: torch.dtype | None = None,
        sliding_window: int | None = None,
        sinks: Tensor | None = None,
        softcap: float = 0.0,
    ) -> Tensor:  # [T, num_heads, head_dim] in q's dtype
        check_softcap(softcap)
        check_window(sliding_window)
        if self._kernel is not None:
            out = self._kernel_attention(q, k, v, scale, sliding_window, sinks, softcap)
            if out is not None:
                return out
        window_reaches = sliding_window is not None and sliding_window < self._longest
        if window_reaches or sinks is not None or softcap:
            return self._dense_backend().forward(
                q, k, v, k_cache, v_cache, meta, scale, None, sliding_window, sinks, softcap
            )
        return self._per_row(q, k, v, scale)

    def _kernel_attention(
        self,
        q: Tensor,  # [T, Hq, D]
        k: Tensor,  # [T, Hkv, D]
        v: Tensor,  # [T, Hkv, D]
        scale: float,
        sliding_window: int | None,
        sinks: Tensor | None,
        softcap: float,
    ) -> Tensor | None:  # [T, Hq, D] q's dtype, or None where the kernel has no path for these operands
        assert self._kernel is not None
        _, hkv, d = k.shape
        if not self._kernel.prefill_supported(q.dtype, torch.bfloat16, d):
            return None
        k_cache = torch.empty(self._num_blocks, BLOCK_SIZE, hkv, d, dtype=torch.bfloat16)
        v_cache = torch.empty_like(k_cache)
        if k.dtype == torch.float32 and k.stride(2) == 1 and k.stride(1) == d and v.stride() == k.stride():
            self._kernel.store_kv(k_cache, v_cache, self._slots, k, v)
        else:  # bf16 K/V (a bf16 model), or rows the store cannot take: rounded by torch alike
            k_cache.view(-1, hkv, d).index_copy_(0, self._slots, k.to(torch.bfloat16))
            v_cache.view(-1, hkv, d).index_copy_(0, self._slots, v.to(torch.bfloat16))
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        sinks = None if sinks is None else sinks.float().contiguous()
        done = self._kernel.prefill(
            out,
            q,
            k_cache,
            v_cache,
            self._tables,
            self._chunks,
            scale,
            indices_checked=True,  # made above from the batch's own lengths
            sliding_window=sliding_window,
            sinks=sinks,
            softcap=softcap,
        )
        return out if done else None

    def _per_row(
        self,
        q: Tensor,  # [T, Hq, D]
        k: Tensor,  # [T, Hkv, D]
        v: Tensor,  # [T, Hkv, D]
        scale: float,
    ) -> Tensor:  # [T, Hq, D]
        out = torch.empty(q.shape, dtype=q.dtype)
        gqa = k.shape[1] != q.shape[1]
        causal = not self._bidirectional
        for start, n in zip(self._starts, self._lens, strict=True):
            if n == 0:
                continue
            rows = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                k[rows].transpose(0, 1),
                v[rows].transpose(0, 1),
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )  # [Hq, n, D]
            out[rows] = o.transpose(0, 1)
        return out
