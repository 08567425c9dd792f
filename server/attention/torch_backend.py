"""Attention over the paged KV cache on CPU: torch ops, plus the compiled decode kernel when given.

KV cache layout, per layer: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim];
slot s = block_id * block_size + offset. A backend first stores this step's K/V at their slots for the
whole batch, then attends, so a sequence may read blocks another sequence writes in the same step
(prefix-cache sharing).

The cache may be narrower than q (--kv-cache-dtype, kv_cache_dtype.py): K/V are rounded to it when
stored (torch's `.to()`, round to nearest even) and widened to q's dtype when read, so attention over
cached tokens computes in q's dtype (fp32 for a quantized GGUF). A prompt chunk with no cached prefix
attends over its own K/V rounded the same way, so a prefix-cache hit, a chunked prefill and a whole one
see the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from server.attention.cpu_kernel import DecodeKernel, check_decode_indices, supports_dtype
from server.attention.metadata import AttentionMetadata


@dataclass
class _DecodeGather:
    """What the torch decode path copies out of the cache; the compiled kernel needs none of it."""

    blocks: Tensor  # [Sd * nb] int64, the first nb blocks of each table (L = nb * block_size)
    num_blocks: int  # nb, enough blocks for the longest context
    mask: Tensor  # [Sd, 1, 1, L] bool, True where the position is inside the context


@dataclass
class _DecodePlan:
    seqs: Tensor  # [Sd] int64, index of each decode sequence in the batch
    rows: Tensor  # [Sd] int64, row in T of each decode sequence's token
    gather: _DecodeGather | None  # None when the compiled kernel serves the decode rows


@dataclass
class _PrefillSeq:
    start: int  # first row in T
    query_len: int
    context_len: int
    blocks: Tensor | None  # [nb] int64, blocks holding the context; None when there is no cached prefix
    mask: Tensor | None  # [query_len, context_len] bool, None when plain causal works


@dataclass
class _Plan:
    decode: _DecodePlan | None
    prefill: list[_PrefillSeq]


def _decode_attention_upcast(
    q: Tensor,  # [Sd, Hq, D]
    k: Tensor,  # [Sd, Hkv, L, D]
    v: Tensor,  # [Sd, Hkv, L, D]
    mask: Tensor,  # [Sd, 1, 1, L] bool
    scale: float,
) -> Tensor:  # [Sd, Hq, D] fp32
    # CPU SDPA is several times slower than this for one query token in bf16/fp16 (measured here), and
    # small bf16 batched matmuls are slow too: upcast once and do the little math in fp32.
    sd, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(sd, hkv, hq // hkv, d)  # [Sd, Hkv, G, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [Sd, Hkv, G, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).view(sd, hq, d)


class TorchAttentionBackend:
    """Attention for CPU. Single-token (decode) sequences: the compiled kernel when one is given (it
    reads the paged cache in place), else a gather of their blocks and one batched SDPA. Longer chunks:
    one SDPA each. The plan (slots, masks) is built once per step and reused by every layer."""

    def __init__(self, block_size: int, decode_kernel: DecodeKernel | None = None) -> None:
        self.block_size = block_size
        self.decode_kernel = decode_kernel
        self.name = "cpu" if decode_kernel is not None else "torch"
        self._meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None

    def _make_plan(self, meta: AttentionMetadata, use_kernel: bool, cache_shape: torch.Size) -> _Plan:
        bs = self.block_size
        device = meta.block_tables.device
        qsl = [0]
        for n in meta.query_lens_cpu:
            qsl.append(qsl[-1] + n)
        decode_seqs = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        decode: _DecodePlan | None = None
        if decode_seqs:
            idx = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
            rows = torch.tensor([qsl[i] for i in decode_seqs], dtype=torch.int64, device=device)
            gather: _DecodeGather | None = None
            if use_kernel:
                # Once per step rather than in every layer's kernel call.
                check_decode_indices(qsl[-1], cache_shape, meta.block_tables, meta.context_lens, idx, rows)
            else:
                ctx = meta.context_lens.index_select(0, idx).to(torch.int64)  # [Sd]
                nb = -(-max(meta.context_lens_cpu[i] for i in decode_seqs) // bs)
                pos = torch.arange(nb * bs, device=device)  # [L]
                tables = meta.block_tables.index_select(0, idx)[:, :nb].to(torch.int64)  # [Sd, nb]
                gather = _DecodeGather(
                    blocks=tables.reshape(-1),
                    num_blocks=nb,
                    mask=(pos[None, :] < ctx[:, None])[:, None, None, :],
                )
            decode = _DecodePlan(seqs=idx, rows=rows, gather=gather)
        prefill: list[_PrefillSeq] = []
        for i, n in enumerate(meta.query_lens_cpu):
            if n == 1:
                continue
            ctx_len = meta.context_lens_cpu[i]
            prefix = ctx_len - n
            blocks_i: Tensor | None = None
            mask_i: Tensor | None = None
            if prefix > 0:
                pos = torch.arange(ctx_len, device=device)
                blocks_i = meta.block_tables[i, : -(-ctx_len // bs)].to(torch.int64)
                q_pos = torch.arange(prefix, ctx_len, device=device)
                mask_i = pos[None, :] <= q_pos[:, None]
            prefill.append(_PrefillSeq(qsl[i], n, ctx_len, blocks_i, mask_i))
        return _Plan(decode, prefill)

    def forward(
        self,
        q: Tensor,  # [T, num_heads, head_dim]
        k: Tensor,  # [T, num_kv_heads, head_dim]
        v: Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:  # [T, num_heads, head_dim]
        if meta is not self._meta:
            self._plan = self._make_plan(meta, self._use_kernel(q.dtype, k_cache.dtype), k_cache.shape)
            self._meta = meta
        plan = self._plan
        assert plan is not None
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        sd_shape = (-1, num_kv_heads, head_dim)
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)

        d = plan.decode
        if d is not None and d.gather is None:
            assert self.decode_kernel is not None
            self.decode_kernel(
                out,
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                d.seqs,
                d.rows,
                scale,
                indices_checked=True,
            )
        elif d is not None and d.gather is not None:
            g = d.gather
            qd = q.index_select(0, d.rows)  # [Sd, Hq, D]
            # Whole blocks are copied with index_select: ~4x faster than gathering token by token.
            sd, length = d.rows.shape[0], g.num_blocks * self.block_size
            kd = k_cache.index_select(0, g.blocks).view(sd, length, *sd_shape[1:]).transpose(1, 2)
            vd = v_cache.index_select(0, g.blocks).view(sd, length, *sd_shape[1:]).transpose(1, 2)
            # kd, vd: [Sd, Hkv, L, D]
            if q.dtype == torch.float32:
                kd, vd = kd.float(), vd.float()  # a no-op for an fp32 cache
                # The G query heads sharing a KV head become G query rows of one attention: each KV
                # block is read once per KV head instead of once per query head.
                qg = qd.view(sd, num_kv_heads, -1, head_dim)  # [Sd, Hkv, G, D]
                od = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=g.mask, scale=scale)
                od = od.reshape(sd, -1, head_dim)
            else:
                od = _decode_attention_upcast(qd, kd, vd, g.mask, scale).to(q.dtype)
            out.index_copy_(0, d.rows, od)

        for s in plan.prefill:
            rows = slice(s.start, s.start + s.query_len)
            # 4-D [1, H, n, D] operands: with 3-D ones CPU SDPA takes its math path, ~2x slower here.
            qs = q[rows].transpose(0, 1)[None]  # [1, Hq, n, D]
            if s.blocks is None:
                ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]  # [1, Hkv, n, D]
                if k_cache.dtype != q.dtype:  # what a later chunk or a prefix hit reads from the cache
                    ks, vs = ks.to(k_cache.dtype).to(q.dtype), vs.to(v_cache.dtype).to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                ks = k_cache.index_select(0, s.blocks).view(sd_shape)[: s.context_len].transpose(0, 1)[None]
                vs = v_cache.index_select(0, s.blocks).view(sd_shape)[: s.context_len].transpose(0, 1)[None]
                # ks, vs: [1, Hkv, ctx, D], widened to q's dtype (a no-op when the cache has it)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=gqa)
            out[rows] = o[0].transpose(0, 1)
        return out

    def _use_kernel(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return self.decode_kernel is not None and supports_dtype(dtype, cache_dtype)
