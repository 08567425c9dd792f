"""Paged attention with tanh soft-capped scores (Gemma 2: `attn_logit_softcapping`), in plain torch.

The attention backends (server/attention/) take no soft-cap, so a layer whose `LayerSpec.attn_softcap`
is set writes its K/V into the paged cache and attends here, one sequence at a time: exact (fp32
softmax over `cap * tanh(scores / cap)`, as transformers' eager Gemma 2 attention) and slow (a
per-sequence loop). It serves any backend's cache layout `[num_blocks, block_size, Hkv, D]`.

With the fused CPU ops (`ops`, fp32 on CPU) a pure-decode step attends through their compiled
`softcap_paged_decode` instead, the very kernel the decode graph (decode_graph.py) calls for these layers,
so that the graph and the Python fused path agree bit for bit; this function stays its reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from server.attention import AttentionMetadata
from server.models.cpu_fused import FusedOps


def softcap_paged_attention(
    q: Tensor,  # [T, Hq, D]
    k: Tensor,  # [T, Hkv, D]
    v: Tensor,  # [T, Hkv, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int | None = None,
    ops: FusedOps | None = None,  # the fused CPU ops: pure-decode fp32 steps run their compiled kernel
) -> Tensor:  # [T, Hq, D] in q's dtype
    """Stores k/v at `meta.slot_mapping`, then causal attention of each sequence's new queries over its
    whole context (cached prefix + this step's tokens); `sliding_window`: keys more than that many
    positions behind a query are masked (transformers' window: query position - key position < window)."""
    hkv, d = k.shape[1], k.shape[2]
    block_size = k_cache.shape[1]
    k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if ops is not None and meta.is_pure_decode and q.dtype == torch.float32 and q.device.type == "cpu":
        return ops.softcap_paged_decode(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, softcap, sliding_window
        )
    out = torch.empty_like(q)
    group = q.shape[1] // hkv
    start = 0
    for i, n in enumerate(meta.query_lens_cpu):
        ctx = meta.context_lens_cpu[i]
        nb = -(-ctx // block_size)
        blocks = meta.block_tables[i, :nb].to(torch.int64)
        # [ctx, Hkv, D] -> [Hq, ctx, D]
        keys = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(group, 1).transpose(0, 1)
        vals = v_cache[blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(group, 1).transpose(0, 1)
        qs = q[start : start + n].float().transpose(0, 1)  # [Hq, n, D]
        scores = torch.matmul(qs, keys.transpose(1, 2)) * scale  # [Hq, n, ctx]
        scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        masked = k_pos > q_pos
        if sliding_window is not None:
            masked |= q_pos - k_pos >= sliding_window
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n] = torch.matmul(probs, vals).transpose(0, 1).to(q.dtype)
        start += n
    return out
