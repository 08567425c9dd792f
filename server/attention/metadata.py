"""What an attention backend needs to know about one step's varlen batch."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # KV layer groups 1.. (server/core/kv_groups.py): the same batch over each group's own blocks (its
    # slot_mapping and block_tables); empty where the cache has one group.
    kv_groups: tuple[AttentionMetadata, ...] = field(default=())

    def group(self, g: int) -> AttentionMetadata:
        """The metadata a layer of KV group g reads: this one for group 0."""
        return self if g == 0 else self.kv_groups[g - 1]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
