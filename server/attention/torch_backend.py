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

Exception: with the compiled kernel over a bf16 cache where AVX512-BF16 is usable (fp32 or bf16 q, head_dim
64, 128 or 256), every prompt chunk goes through its prefill attention instead (`DecodeKernel.prefill`): bf16
products of q * scale, K, P and V with fp32 maxima, sums and output, flash-attention style, 2.0-2.3x the
SDPA path on an AMD EPYC with AVX512-BF16 (benchmarks/cpu_attention.py; head_dim 256, Gemma 2/3's: 1.47x,
docs/benchmarks-log.md); a bf16 model's q is widened for it and its rows rounded back to bf16 (a 4,096-token
prompt's prefill 1.57x faster than torch's bf16 SDPA on a Zen 5). All chunks take it, so those
three still compute alike. Where AMX-BF16 is usable too (`DecodeKernel.amx_bf16`), the prompt chunks go
to the SDPA groups in bf16 instead: q rounded to bf16, K/V as the bf16 cache holds them, torch's bf16
SDPA (oneDNN's brgemm on AMX tiles: 1.6-3x the kernel there, 2026-12-02), its bf16 output widened to fp32
(the o projection rounds it to bf16 again at prefill sizes). Again all chunks alike.

An int8 cache (`--kv-cache-dtype int8`, int8_kv.py) needs the compiled kernel: every write goes through
its quantizing store (`DecodeKernel.store_kv`), decode rows through its decode pass; prompt chunks attend
over the rows read back dequantized (their own K/V too, as later steps will read them), through the SDPA
groups, in bf16 where AMX-BF16 is usable (as for a bf16 cache), else in q's dtype.

A soft-capped layer (`softcap` > 0, Gemma 2's `attn_logit_softcapping`: each scaled score s becomes
cap * tanh(s / cap) before the mask and softmax) cannot take SDPA, which has no such term: its decode rows
go to the compiled kernel or the fp32 gather path, its prompt chunks to the compiled prefill kernel where
it runs (AMX too), else to `_capped_attention`, the groups' SDPA spelled out in fp32 matmuls.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from server.attention import int8_kv
from server.attention.cpu_kernel import (
    DecodeKernel,
    PrefillChunks,
    check_decode_indices,
    check_prefill_chunks,
    check_sinks,
    check_softcap,
    check_window,
    supports_dtype,
)
from server.attention.metadata import AttentionMetadata

# Metadata whose plans are kept: a step's KV layer groups (two at most) and the previous step's.
_KEPT_METAS = 4
# Query rows per matmul in `_capped_attention`: its fp32 scores are [B, Hq, rows, L], kept to a few MB, and
# each tile reads only the keys its rows see (causal, window).
_CAPPED_ROWS = 128


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
class _PrefillGroup:
    """Prompt chunks of one shape (query length, context length, cached prefix or not): one SDPA call
    [B, H, n, D] for all of them, ~1.3x (no prefix) to 3-5x (a cached prefix, masked) faster on CPU than
    B calls of [1, H, n, D] (measured here, 2 threads)."""

    starts: list[int]  # first row in T of each chunk
    query_len: int  # n
    context_len: int  # cached prefix + n
    rows: Tensor | None  # [B * n] int64 rows in T, None when the chunks lie back to back from starts[0]
    blocks: Tensor | None  # [B * nb] int64, blocks holding each context; None when there is no cached prefix
    # [n, context_len] in q's dtype, 0 or -inf (lower-right causal, less what is past a sliding window);
    # None: plain causal
    mask: Tensor | None


@dataclass
class _Plan:
    decode: _DecodePlan | None
    prefill: list[_PrefillGroup]  # empty when `chunks` serves every prompt chunk
    chunks: PrefillChunks | None = None  # the compiled prefill kernel's chunks (DecodeKernel.prefill)
    compute: torch.dtype | None = None  # the prefill groups' SDPA dtype where it is not q's (bf16 on AMX)


def _prefill_groups(
    meta: AttentionMetadata, qsl: list[int], block_size: int, dtype: torch.dtype, window: int
) -> list[_PrefillGroup]:
    """`window`: 0, or the layer's sliding window W (a query at position p sees keys p - W + 1 .. p)."""
    device = meta.block_tables.device
    shapes: dict[tuple[int, int], list[int]] = {}  # (n, context_len) -> sequences, in batch order
    for i, n in enumerate(meta.query_lens_cpu):
        if n > 1:
            shapes.setdefault((n, meta.context_lens_cpu[i]), []).append(i)
    groups: list[_PrefillGroup] = []
    for (n, ctx_len), seqs in shapes.items():
        starts = [qsl[i] for i in seqs]
        rows: Tensor | None = None
        if starts != list(range(starts[0], starts[0] + n * len(starts), n)):
            rows = torch.cat([torch.arange(s, s + n, device=device) for s in starts])
        blocks: Tensor | None = None
        mask: Tensor | None = None
        if ctx_len > n:  # a cached prefix: the chunk reads it from the cache
            nb = -(-ctx_len // block_size)
            idx = torch.tensor(seqs, dtype=torch.int64, device=device)
            blocks = meta.block_tables.index_select(0, idx)[:, :nb].to(torch.int64).reshape(-1)
        if ctx_len > n or 0 < window < n:  # a cached prefix, or a window shorter than the chunk
            pos = torch.arange(ctx_len, device=device)
            q_pos = torch.arange(ctx_len - n, ctx_len, device=device)
            hidden = pos[None, :] > q_pos[:, None]
            if window:
                hidden |= pos[None, :] <= q_pos[:, None] - window
            # An additive mask: CPU SDPA with a bool one is slower here (it converts it each call).
            mask = torch.zeros(n, ctx_len, dtype=dtype, device=device)
            mask.masked_fill_(hidden, float("-inf"))
        groups.append(_PrefillGroup(starts, n, ctx_len, rows, blocks, mask))
    return groups


def _decode_attention_upcast(
    q: Tensor,  # [Sd, Hq, D]
    k: Tensor,  # [Sd, Hkv, L, D]
    v: Tensor,  # [Sd, Hkv, L, D]
    mask: Tensor,  # [Sd, 1, 1, L] bool
    scale: float,
    sinks: Tensor | None = None,  # [Hq] fp32
    softcap: float = 0.0,  # 0, or the attention logit soft-cap (check_softcap)
) -> Tensor:  # [Sd, Hq, D] fp32
    # CPU SDPA is several times slower than this for one query token in bf16/fp16 (measured here), and
    # small bf16 batched matmuls are slow too: upcast once and do the little math in fp32. Sinks and
    # soft-caps take this path in fp32 too: SDPA has no term for them.
    sd, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(sd, hkv, hq // hkv, d)  # [Sd, Hkv, G, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [Sd, Hkv, G, L]
    if softcap:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # the sink as one more score column, dropped after the softmax (it has no value row)
        sink_col = sinks.view(1, hkv, hq // hkv, 1).expand(sd, -1, -1, 1)
        probs = torch.cat([scores, sink_col], -1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float()).view(sd, hq, d)


def _capped_attention(
    q: Tensor,  # [B, Hq, n, D]
    k: Tensor,  # [B, Hkv, L, D]
    v: Tensor,  # [B, Hkv, L, D]
    mask: Tensor | None,  # [n, L] additive, or None: lower-right causal (L == n)
    scale: float,
    softcap: float,  # > 0
    sinks: Tensor | None,  # [Hq] fp32
    window: int,  # 0, or the sliding window the mask holds (only to skip keys no row of a tile sees)
) -> Tensor:  # [B, Hq, n, D] fp32
    """What SDPA computes for a prefill group, with every scaled score s taken as cap * tanh(s / cap)
    before the mask (transformers' Gemma 2 eager attention), in fp32; sinks as a last score column. The
    G query heads of a KV head are G * rows rows of one matmul over that head's keys (no repeated K/V),
    `_CAPPED_ROWS` query rows at a time over the keys they see."""
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    if mask is None:
        mask = torch.full((n, length), float("-inf")).triu_(length - n + 1)
    kf, vf = k.float(), v.float()
    out = torch.empty(b, hkv, g, n, d)
    for r0 in range(0, n, _CAPPED_ROWS):
        r1 = min(n, r0 + _CAPPED_ROWS)
        rows = r1 - r0
        # keys [k0, k1): up to the tile's last query's position, from its first query's window start
        k1 = length - n + r1
        k0 = max(0, length - n + r0 - window + 1) if window else 0
        qg = q[:, :, r0:r1].float().reshape(b, hkv, g * rows, d)
        scores = torch.matmul(qg, kf[:, :, k0:k1].transpose(-1, -2))  # [B, Hkv, G * rows, k1 - k0]
        scores = scores.mul_(scale / softcap).tanh_().mul_(softcap).view(b, hkv, g, rows, k1 - k0)
        scores += mask[r0:r1, k0:k1].float()
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink_col = sinks.view(1, hkv, g, 1, 1).expand(b, -1, -1, rows, 1)
            probs = torch.cat([scores, sink_col], -1).softmax(-1)[..., :-1]
        out[:, :, :, r0:r1] = torch.matmul(probs.reshape(b, hkv, g * rows, k1 - k0), vf[:, :, k0:k1]).view(
            b, hkv, g, rows, d
        )
    return out.view(b, hq, n, d)


def _with_sink_key(
    ks: Tensor,  # [B, Hkv, L, D]
    vs: Tensor,  # [B, Hkv, L, D]
    mask: Tensor | None,  # [n, L] additive, or None: lower-right causal (L == n)
    sinks: Tensor,  # [Hq] fp32
    n: int,
) -> tuple[Tensor, Tensor, Tensor]:  # K, V [B, Hkv, L + 1, D] and an additive mask [1, Hq, n, L + 1]
    """Attention sinks through SDPA: one extra key and value of zeros, whose score (q . 0 = 0) the mask
    turns into the head's sink logit, so the softmax's denominator gains exp(sink) and the output
    nothing from its row: exactly transformers' concatenated sink column."""
    length, hq, dtype = ks.shape[2], sinks.shape[0], ks.dtype
    if mask is None:
        mask = torch.full((n, length), float("-inf"), dtype=dtype).triu_(length - n + 1)
    full = torch.cat(
        [mask.to(dtype).expand(hq, n, length), sinks.to(dtype).view(hq, 1, 1).expand(hq, n, 1)], -1
    )
    return F.pad(ks, (0, 0, 0, 1)), F.pad(vs, (0, 0, 0, 1)), full[None]


class TorchAttentionBackend:
    """Attention for CPU. Single-token (decode) sequences: the compiled kernel when one is given (it
    reads the paged cache in place), else a gather of their blocks and one batched SDPA. Longer chunks:
    the kernel's prefill attention where it runs (module docstring), else one SDPA per group of chunks
    of the same shape (_PrefillGroup). The plan (slots, masks, chunks) is built once per step and reused
    by every layer."""

    def __init__(self, block_size: int, decode_kernel: DecodeKernel | None = None) -> None:
        self.block_size = block_size
        self.decode_kernel = decode_kernel
        self.name = "cpu" if decode_kernel is not None else "torch"
        # per metadata seen lately (a step has one per KV layer group, AttentionMetadata.group): the
        # metadata itself (so its id stays unique while kept) and its plans per (sliding window (0: none),
        # soft-capped or not)
        self._plans_by_meta: OrderedDict[int, tuple[AttentionMetadata, dict[tuple[int, bool], _Plan]]] = (
            OrderedDict()
        )

    def _make_plan(
        self,
        meta: AttentionMetadata,
        use_kernel: bool,
        cache_shape: torch.Size,
        dtype: torch.dtype,
        cache_dtype: torch.dtype,
        head_dim: int,
        window: int = 0,  # check_window's: 0 or the layer's sliding window
        capped: bool = False,  # a soft-capped layer: no SDPA, so not the bf16 SDPA groups either
    ) -> _Plan:
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
                visible = pos[None, :] < ctx[:, None]  # [Sd, L]
                if window:
                    visible &= pos[None, :] >= ctx[:, None] - window
                gather = _DecodeGather(
                    blocks=tables.reshape(-1), num_blocks=nb, mask=visible[:, None, None, :]
                )
            decode = _DecodePlan(seqs=idx, rows=rows, gather=gather)
        kernel = self.decode_kernel
        amx = kernel is not None and kernel.amx_bf16 and not capped
        if (
            amx
            and kernel is not None
            and (kernel.prefill_supported(dtype, cache_dtype, head_dim) or cache_dtype == torch.int8)
        ):
            # Every prompt chunk through torch's bf16 SDPA over the bf16 K/V (module docstring).
            return _Plan(
                decode, _prefill_groups(meta, qsl, bs, torch.bfloat16, window), compute=torch.bfloat16
            )
        if kernel is not None and kernel.prefill_supported(dtype, cache_dtype, head_dim):
            # Every prompt chunk, with a cached prefix or not, through the one kernel: a prefix-cache hit,
            # a chunked and a whole prefill compute alike.
            seqs = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
            if not seqs:
                return _Plan(decode, [])
            chunks = PrefillChunks(
                seqs=torch.tensor(seqs, dtype=torch.int64),
                q_starts=torch.tensor([qsl[i] for i in seqs], dtype=torch.int64),
                q_lens=torch.tensor([meta.query_lens_cpu[i] for i in seqs], dtype=torch.int32),
                ctx_lens=torch.tensor([meta.context_lens_cpu[i] for i in seqs], dtype=torch.int32),
            )
            check_prefill_chunks(qsl[-1], cache_shape, meta.block_tables, chunks)
            return _Plan(decode, [], chunks)
        prefill = _prefill_groups(meta, qsl, bs, dtype, window)
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
        out_dtype: torch.dtype | None = None,  # honoured where every row comes from the bf16 SDPA groups
        sliding_window: int | None = None,
        sinks: Tensor | None = None,  # [num_heads] fp32, contiguous
        softcap: float = 0.0,
    ) -> Tensor:  # [T, num_heads, head_dim] in q's dtype, or bf16 (above)
        """`sliding_window` W (this layer's): the query at position p attends to keys p - W + 1 .. p only
        (transformers' sliding_window_overlay for Mistral, Qwen2, Gemma 2/3); None: p's whole prefix.
        `sinks`: attention sinks (AttentionBackend): the compiled kernels take them in their merge, the
        torch decode path as a score column, SDPA as a zero key (`_with_sink_key`). `softcap`: 0, or the
        layer's attention logit soft-cap (Gemma 2: scores cap * tanh(s / cap) before the mask; module
        docstring). Raises ValueError for W < 1 or a negative or non-finite soft-cap, TypeError/ValueError
        for sinks not [num_heads] fp32."""
        window = check_window(sliding_window)
        cap = check_softcap(softcap)
        check_sinks(sinks, q.shape[1])
        kept = self._plans_by_meta.get(id(meta))
        if kept is None or kept[0] is not meta:
            kept = self._plans_by_meta[id(meta)] = (meta, {})
            while len(self._plans_by_meta) > _KEPT_METAS:
                self._plans_by_meta.popitem(last=False)
        plans = kept[1]
        plan = plans.get((window, cap > 0))
        if plan is None:
            plan = plans[window, cap > 0] = self._make_plan(
                meta,
                self._use_kernel(q.dtype, k_cache.dtype),
                k_cache.shape,
                q.dtype,
                k_cache.dtype,
                q.shape[2],
                window,
                cap > 0,
            )
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        sd_shape = (-1, num_kv_heads, head_dim)
        if k_cache.dtype == torch.int8:
            own = any(grp.blocks is None for grp in plan.prefill)
            k_stored, v_stored = self._store_int8(k, v, k_cache, v_cache, meta.slot_mapping, q.dtype, own)
        else:
            flat_k = k_cache.view(-1, num_kv_heads, head_dim)
            flat_v = v_cache.view(-1, num_kv_heads, head_dim)
            k_stored, v_stored = k.to(k_cache.dtype), v.to(v_cache.dtype)  # [T, Hkv, D]
            flat_k.index_copy_(0, meta.slot_mapping, k_stored)
            flat_v.index_copy_(0, meta.slot_mapping, v_stored)
        gqa = q.shape[1] != num_kv_heads
        cd = plan.compute or q.dtype  # the SDPA's dtype: K/V as the cache holds them where it is the cache's
        # Every row from the bf16 SDPA groups and a caller that takes bf16: their output as it is
        keep = plan.decode is None and plan.chunks is None and out_dtype == cd != q.dtype
        out = torch.empty(q.shape, dtype=cd if keep else q.dtype)

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
                sliding_window=window or None,
                sinks=sinks,
                softcap=cap,
            )
        elif d is not None and d.gather is not None:
            g = d.gather
            qd = q.index_select(0, d.rows)  # [Sd, Hq, D]
            # Whole blocks are copied with index_select: ~4x faster than gathering token by token.
            sd, length = d.rows.shape[0], g.num_blocks * self.block_size
            kd = _read_blocks(k_cache, g.blocks, q.dtype).view(sd, length, *sd_shape[1:]).transpose(1, 2)
            vd = _read_blocks(v_cache, g.blocks, q.dtype).view(sd, length, *sd_shape[1:]).transpose(1, 2)
            # kd, vd: [Sd, Hkv, L, D]
            if q.dtype == torch.float32 and sinks is None and not cap:
                kd, vd = kd.float(), vd.float()  # a no-op for an fp32 cache
                # The G query heads sharing a KV head become G query rows of one attention: each KV
                # block is read once per KV head instead of once per query head.
                qg = qd.view(sd, num_kv_heads, -1, head_dim)  # [Sd, Hkv, G, D]
                od = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=g.mask, scale=scale)
                od = od.reshape(sd, -1, head_dim)
            else:
                od = _decode_attention_upcast(qd, kd, vd, g.mask, scale, sinks, cap).to(q.dtype)
            out.index_copy_(0, d.rows, od)

        if plan.chunks is not None:
            assert self.decode_kernel is not None
            done = self.decode_kernel.prefill(
                out,
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                plan.chunks,
                scale,
                indices_checked=True,
                sliding_window=window or None,
                sinks=sinks,
                softcap=cap,
            )
            assert done, "prefill_supported said the kernel serves these chunks"
        for grp in plan.prefill:
            b, n = len(grp.starts), grp.query_len
            if grp.rows is None:
                rows: slice | Tensor = slice(grp.starts[0], grp.starts[0] + b * n)
                qs, ks, vs = q[rows], k_stored[rows], v_stored[rows]
            else:
                rows = grp.rows
                qs = q.index_select(0, rows)
                ks, vs = k_stored.index_select(0, rows), v_stored.index_select(0, rows)
            # 4-D [B, H, n, D] operands: with 3-D ones CPU SDPA takes its math path, ~2x slower here.
            qs = qs.view(b, n, -1, head_dim).transpose(1, 2).to(cd)  # [B, Hq, n, D]
            if grp.blocks is None:
                # what a later chunk or a prefix hit reads from the cache, widened (a no-op when cd is its dtype)
                ks, vs = ks.to(cd), vs.to(cd)
                ks, vs = (
                    ks.view(b, n, *sd_shape[1:]).transpose(1, 2),
                    vs.view(b, n, *sd_shape[1:]).transpose(1, 2),
                )
                # ks, vs: [B, Hkv, n, D]
                if cap:
                    o = _capped_attention(qs, ks, vs, grp.mask, scale, cap, sinks, window)
                elif sinks is not None:
                    ks, vs, sink_mask = _with_sink_key(ks, vs, grp.mask, sinks, n)
                    o = F.scaled_dot_product_attention(
                        qs, ks, vs, attn_mask=sink_mask, scale=scale, enable_gqa=gqa
                    )
                else:
                    o = F.scaled_dot_product_attention(
                        qs,
                        ks,
                        vs,
                        is_causal=grp.mask is None,
                        attn_mask=grp.mask,
                        scale=scale,
                        enable_gqa=gqa,
                    )
            else:
                length = grp.blocks.shape[0] // b * self.block_size
                ks = _read_blocks(k_cache, grp.blocks, cd).view(b, length, *sd_shape[1:])[
                    :, : grp.context_len
                ]
                vs = _read_blocks(v_cache, grp.blocks, cd).view(b, length, *sd_shape[1:])[
                    :, : grp.context_len
                ]
                # ks, vs: [B, Hkv, ctx, D], widened to q's dtype (a no-op when the cache has it)
                ks, vs = ks.transpose(1, 2).to(cd), vs.transpose(1, 2).to(cd)
                mask = grp.mask
                if cap:
                    o = _capped_attention(qs, ks, vs, mask, scale, cap, sinks, window)
                else:
                    if sinks is not None:
                        ks, vs, mask = _with_sink_key(ks, vs, grp.mask, sinks, n)
                    o = F.scaled_dot_product_attention(
                        qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
                    )
            # SDPA's output is [B, Hq, n, D] in memory: one copy into rows [B * n, Hq, D] in out's dtype
            o = (
                torch.empty(b, n, *q.shape[1:], dtype=out.dtype)
                .copy_(o.transpose(1, 2))
                .view(b * n, *q.shape[1:])
            )
            if d is None and grp.rows is None and b * n == q.shape[0]:
                # the whole batch is this one group, in order: those rows are the answer, without a
                # second copy into `out`
                return o
            if grp.rows is None:
                out[rows] = o
            else:
                out.index_copy_(0, grp.rows, o)
        return out

    def _store_int8(
        self,
        k: Tensor,  # [T, Hkv, D]
        v: Tensor,  # [T, Hkv, D]
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D] int8 (int8_kv)
        v_cache: Tensor,  # like k_cache
        slots: Tensor,  # [T] int64
        dtype: torch.dtype,
        read_back: bool,
    ) -> tuple[Tensor, Tensor]:  # [T, Hkv, D] in dtype each, or (k, v) as given when not read_back
        """K/V quantized into an int8 cache by the compiled store; with `read_back`, the rows as stored,
        dequantized (what a chunk's own attention reads, as later steps read them from the cache)."""
        if self.decode_kernel is None:
            raise RuntimeError(
                "an int8 KV cache needs the compiled CPU attention kernel, which is not loaded"
            )
        kf, vf = k.float(), v.float()
        if kf.stride() != vf.stride() or kf.stride()[1:] != (k.shape[2], 1):
            # one buffer: the same strides for both (`contiguous()` keeps a size-1 dimension's stride)
            both = torch.empty((2, *k.shape), dtype=torch.float32)
            kf, vf = both[0].copy_(k), both[1].copy_(v)
        self.decode_kernel.store_kv(k_cache, v_cache, slots, kf, vf)
        if not read_back:
            return k, v
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return tuple(  # type: ignore[return-value]
            int8_kv.dequantize(c[blocks, offsets], int8_kv.scales(c)[blocks, offsets], dtype)
            for c in (k_cache, v_cache)
        )

    def _use_kernel(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return self.decode_kernel is not None and supports_dtype(dtype, cache_dtype)


def _read_blocks(
    cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    blocks: Tensor,  # [B] int64
    dtype: torch.dtype,
) -> Tensor:  # [B, block_size, Hkv, D]: a float cache's dtype (the caller widens), an int8 one's in dtype
    """Whole blocks out of the cache: ~4x faster than gathering token by token."""
    if cache.dtype == torch.int8:
        return int8_kv.gather_blocks(cache, blocks, dtype)
    return cache.index_select(0, blocks)
