"""SchedulerOutput -> tensors. The only place where block ids become tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from server.attention.metadata import AttentionMetadata
from server.core.outputs import SchedulerOutput
from server.request import LoRARequest


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: Tensor  # [num_sampled] int64, row in T of the last token of each sampling sequence
    sampled_request_ids: list[str]  # the sequences behind logits_indices, in order
    request_ids: list[str]  # every scheduled sequence, in batch order
    # Speculating sequences (speculative decoding): each one's last known token and its k drafts all
    # need logits. spec_logits_indices: [sum(k_i + 1)] int64, rows in T, sequence after sequence.
    spec_logits_indices: Tensor
    spec_request_ids: list[str]  # in the order of spec_logits_indices
    # per scheduled sequence (batch order): its adapter (None = base model); the LoRA manager turns these
    # and attn.query_lens_cpu into the per-token slot index
    lora_requests: tuple[LoRARequest | None, ...] = ()

    @property
    def has_lora(self) -> bool:
        return any(lora is not None for lora in self.lora_requests)


def _slots_and_tables(
    sched: SchedulerOutput, group: int, block_size: int
) -> tuple[list[int], list[list[int]]]:
    """KV group `group`'s slot of every new token ([T]) and its block-table rows, padded with 0."""
    slots: list[int] = []
    tables: list[tuple[int, ...]] = []
    for item in sched.scheduled:
        table = item.block_ids if group == 0 else item.group_block_ids[group - 1]
        for pos in range(item.start, item.start + item.num_new_tokens):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables.append(table)
    max_blocks = max((len(t) for t in tables), default=1)
    return slots, [list(t) + [0] * (max_blocks - len(t)) for t in tables]


def build_forward_batch(sched: SchedulerOutput, block_size: int, device: torch.device) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_idx: list[int] = []
    sampled_ids: list[str] = []
    request_ids: list[str] = []
    spec_idx: list[int] = []
    spec_ids: list[str] = []
    offset = 0
    for item in sched.scheduled:
        req = item.request
        start, n = item.start, item.num_new_tokens
        known = req.num_tokens
        for pos in range(start, start + n):
            input_ids.append(req.token_at(pos) if pos < known else item.spec_token_ids[pos - known])
            positions.append(pos)
        query_lens.append(n)
        context_lens.append(start + n)
        offset += n
        request_ids.append(req.request_id)
        if item.spec_token_ids:
            spec_idx.extend(range(offset - len(item.spec_token_ids) - 1, offset))
            spec_ids.append(req.request_id)
        elif item.sample:
            logits_idx.append(offset - 1)
            sampled_ids.append(req.request_id)

    num_groups = 1 + (len(sched.scheduled[0].group_block_ids) if sched.scheduled else 0)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)

    def i64(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    def i32(x: list[int] | list[list[int]]) -> Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    ctx, starts = i32(context_lens), i32(qsl)

    def meta(group: int, kv_groups: tuple[AttentionMetadata, ...] = ()) -> AttentionMetadata:
        slots, table_rows = _slots_and_tables(sched, group, block_size)
        return AttentionMetadata(
            slot_mapping=i64(slots),
            block_tables=i32(table_rows),
            context_lens=ctx,
            query_start_loc=starts,
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            query_lens_cpu=tuple(query_lens),
            context_lens_cpu=tuple(context_lens),
            kv_groups=kv_groups,
        )

    attn = meta(0, tuple(meta(g) for g in range(1, num_groups)))
    return ForwardBatch(
        input_ids=i64(input_ids),
        positions=i64(positions),
        attn=attn,
        logits_indices=i64(logits_idx),
        sampled_request_ids=sampled_ids,
        request_ids=request_ids,
        spec_logits_indices=i64(spec_idx),
        spec_request_ids=spec_ids,
        lora_requests=tuple(item.request.lora for item in sched.scheduled),
    )
