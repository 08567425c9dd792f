"""How the KV cache is split into layer groups: full-attention layers and sliding-window layers. No torch.

vLLM's hybrid KV cache manager keeps one block table per layer group (full attention; sliding window
with its window), each freeing what its layers no longer read. Ours keeps one pool and one set of KV
tensors per group: a model whose every layer attends globally (Llama) or whose every layer is windowed
(Mistral) has one group; a model that interleaves windowed and global layers (Gemma 2/3, gpt-oss,
Qwen2/3 with `max_window_layers`) has two, group 0 full and group 1 windowed, so that the windowed
layers' blocks behind the window go back to their pool while the global layers keep the whole context.

The budget (`--kv-cache-memory` in blocks of one layer) is split by bytes (`plan_kv_layout`): the
windowed group gets what its running requests can hold at most (each request's window plus a block on
either side, plus one step's tokens: `window_group_blocks`) or, where that is more, the share one pool
of every layer gives (a sequence shorter than the window holds as many blocks in a windowed layer as
in a global one, so a smaller share would preempt short sequences that one pool held); the full group
gets the rest. Where the global layers would be short of one full-length sequence, the windowed group
gives blocks back down to one sequence's window and chunk, which is what server/memory_estimate.py's
minimum counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroupSpec:
    """One layer group's pool: `num_blocks` blocks; `sliding_window` W in tokens (the widest of its
    layers' windows) or None for full attention."""

    num_blocks: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {w!r}")


@dataclass(frozen=True)
class KVLayout:
    """The KV cache's groups and which group each layer reads: `layer_group[i]` indexes `groups`."""

    groups: tuple[KVGroupSpec, ...]
    layer_group: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV layout needs at least one group")
        if any(not 0 <= g < len(self.groups) for g in self.layer_group):
            raise ValueError(
                f"layer_group {self.layer_group} names a group outside 0..{len(self.groups) - 1}"
            )

    def layer_num_blocks(self, layer: int) -> int:
        return self.groups[self.layer_group[layer]].num_blocks


def window_group_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks the windowed group's running requests hold at once: each request's window
    (W - 1 keys behind its first new token, its own block and one of slack at each edge), plus the
    blocks one step's new tokens fill (a prompt chunk's whole span is stored before it is attended)."""
    return max_num_seqs * (cdiv(window - 1, block_size) + 2) + cdiv(max_num_batched_tokens, block_size)


def window_blocks_per_sequence(
    window: int, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """The most blocks one sequence alone holds in the windowed group: its window and one step's chunk,
    at most its whole context. server/memory_estimate.py counts a windowed layer's sequence by this."""
    return min(
        cdiv(max_model_len, block_size),
        cdiv(window - 1, block_size) + 2 + cdiv(max_num_batched_tokens, block_size),
    )


@dataclass(frozen=True)
class KVPlan:
    """The KV cache an engine allocates: `num_blocks` blocks of every layer in one pool's terms (the
    scheduler's and the logs' count) and the `layout` its layers' caches follow."""

    num_blocks: int
    layout: KVLayout


def plan_engine_kv(
    layer_windows: Sequence[int | None],
    block_bytes: int,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> KVPlan:
    """The engine's KV cache from its settings: `--num-kv-blocks` blocks, else `--kv-cache-memory` over
    `block_bytes` (one block of every layer) and at least one; the layer budget (`--num-kv-blocks`' blocks
    of every layer, else the memory over one layer's share of a block, never less) split by
    `plan_kv_layout`. Rank 0 and every tensor-parallel rank call it with the same per-rank shapes, so
    their layouts agree. ValueError as plan_kv_layout."""
    layers = len(layer_windows)
    num_blocks = num_kv_blocks or max(1, kv_cache_memory_bytes // block_bytes)
    budget = num_blocks * layers
    if not num_kv_blocks:
        budget = max(budget, kv_cache_memory_bytes // max(1, block_bytes // max(1, layers)))
    layout = plan_kv_layout(
        layer_windows, budget, block_size, max_num_seqs, max_num_batched_tokens, max_model_len
    )
    return KVPlan(num_blocks, layout)


def plan_kv_layout(
    layer_windows: Sequence[int | None],
    layer_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> KVLayout:
    """The groups for layers whose windows are `layer_windows` (None: global), given a budget of
    `layer_blocks` blocks of one layer (--kv-cache-memory over one layer's block bytes). Two groups:
    the windowed group gets what its `max_num_seqs` running sequences can hold (window_group_blocks)
    where every sequence of `max_model_len` fits in the full group besides; with less memory the two
    split it as those demands do, the windowed group keeping at least one sequence
    (window_blocks_per_sequence) and the full group one whole sequence where the budget allows, and
    never fewer blocks than one pool of every layer would have (so what fit in one pool still fits).
    Raises ValueError for no layers or a budget below one block per layer."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    n_layers = len(layer_windows)
    if layer_blocks < n_layers:
        raise ValueError(f"a KV budget of {layer_blocks} layer blocks is less than one block per layer")
    windowed = [w for w in layer_windows if w is not None]
    if not windowed or len(windowed) == n_layers:
        widest = max(windowed) if windowed else None
        return KVLayout((KVGroupSpec(layer_blocks // n_layers, widest),), (0,) * n_layers)
    widest = max(windowed)
    n_win = len(windowed)
    n_full = n_layers - n_win
    full_seq = cdiv(max_model_len, block_size)
    # A sequence shorter than the window holds as many blocks in a windowed layer as in a global one,
    # so the windowed group never needs more than the global group's share: it gets what its running
    # windows can use at most, else the share one pool of every layer gives (never fewer blocks than
    # one pool had, whatever the sequences' lengths).
    win = min(
        window_group_blocks(widest, block_size, max_num_seqs, max_num_batched_tokens),
        layer_blocks // n_layers,
    )
    if (layer_blocks - n_win * win) // n_full < full_seq:
        # the global layers short of one full-length sequence: the windowed group gives back down to
        # one sequence's window and chunk (what server/memory_estimate.py's minimum counts)
        min_win = window_blocks_per_sequence(widest, block_size, max_num_batched_tokens, max_model_len)
        win = min(win, max(min_win, (layer_blocks - n_full * full_seq) // n_win))
    win = max(1, win)
    full = (layer_blocks - n_win * win) // n_full
    return KVLayout(
        (KVGroupSpec(full), KVGroupSpec(win, widest)),
        tuple(0 if w is None else 1 for w in layer_windows),
    )
