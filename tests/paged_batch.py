"""Random paged-KV batches and step metadata for the attention tests (not a test module)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from server.attention.metadata import AttentionMetadata

# (atol, rtol) of a kernel output against the fp32 torch reference rounded to the same dtype. 16-bit
# budgets cover one rounding of the output plus, on GPUs, the softmax weights rounded to 16 bits
# before the P @ V tensor-core dot.
ATTN_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2e-2),
}


@dataclass(frozen=True)
class PagedBatch:
    q: Tensor  # [T, num_heads, head_dim]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor  # [num_seqs, max_blocks] int32
    context_lens: Tensor  # [num_seqs] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_context_len: int


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    q_scale: float = 1.0,
) -> PagedBatch:
    """Blocks are handed out shuffled, and every cache slot (unused ones, the tail of each last block,
    padding block 0) holds random data, so a kernel reading outside a context shows up as an error."""
    assert len(query_lens) == len(context_lens)
    blocks_needed = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks - 1) + 1  # block 0 stays the padding entry of the tables
    max_blocks = max(blocks_needed, default=0) + 1  # one extra, unused column
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return PagedBatch(
        q=(torch.randn(qsl[-1], num_heads, head_dim) * q_scale).to(dtype).to(device),
        k_cache=torch.randn(shape).to(dtype).to(device),
        v_cache=torch.randn(shape).to(dtype).to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
    )


def make_attention_metadata(
    query_lens: list[int], prefix_lens: list[int], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Sequences laid out in shuffled blocks; new tokens go to the slots after each prefix."""
    context_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    needed = [math.ceil(c / block_size) for c in context_lens]
    order = (torch.randperm(sum(needed)) + 1).tolist()
    tables: list[list[int]] = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]
    width = max(needed)
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for table, p, c in zip(tables, prefix_lens, context_lens, strict=True)
        for pos in range(p, c)
    ]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens_cpu=tuple(query_lens),
        context_lens_cpu=tuple(context_lens),
    )
