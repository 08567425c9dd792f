"""What an attention backend needs to know about one step's varlen batch."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """What an attention backend needs about the varlen batch (all sequences concatenated)."""

    slot_mapping: Tensor  # [T] int64, cache slot (block_id * block_size + offset) of each new token
    block_tables: Tensor  # [num_seqs, max_blocks] int32, unused entries 0
    context_lens: Tensor  # [num_seqs] int32, KV length of each sequence including this step's tokens
    query_start_loc: Tensor  # [num_seqs + 1] int32, offsets of each sequence's new tokens in T
    max_query_len: int
    max_context_len: int
    # Host copies, so the torch backend can plan without device syncs.
    query_lens_cpu: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
