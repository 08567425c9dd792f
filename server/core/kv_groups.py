"""How the KV cache is split into layer groups: full-attention layers and sliding-window layers. No torch.

vLLM's hybrid KV cache manager keeps one block table per layer group (full attention; sliding window
with its window), each freeing what its layers no longer read. Ours keeps one pool and one set of KV
tensors per group: a model whose every layer attends globally (Llama) or whose every layer is windowed
(Mistral) has one group; a model that interleaves windowed and global layers (Gemma 2/3, gpt-oss,
Qwen2/3 with `max_window_layers`) has two, group 0 full and group 1 windowed, so that the windowed
layers' blocks behind the window go back to their pool while the global layers keep the whole context.

The budget (the blocks one all-layers pool would have, `num_blocks`) is split by bytes: the windowed
group gets what its running requests can hold at most (each request's window plus a block on either
side, plus one step's tokens: `window_group_blocks`), never more than `num_blocks`, and the full group
the rest of the bytes, so the total is the budget and anything that fit in one pool fits in the groups.
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
    per_request = cdiv(window - 1, block_size) + 2
    return max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size)


def plan_kv_layout(
    layer_windows: Sequence[int | None],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> KVLayout:
    """The groups for layers whose windows are `layer_windows` (None: global), given a budget of
    `num_blocks` blocks of every layer (module docstring). Raises ValueError for no layers."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    windowed = [w for w in layer_windows if w is not None]
    n_layers, n_win = len(layer_windows), len(windowed)
    if n_win == 0:
        return KVLayout((KVGroupSpec(num_blocks),), (0,) * n_layers)
    widest = max(windowed)
    if n_win == n_layers:
        return KVLayout((KVGroupSpec(num_blocks, widest),), (0,) * n_layers)
    n_full = n_layers - n_win
    win_blocks = min(
        num_blocks, window_group_blocks(widest, block_size, max_num_seqs, max_num_batched_tokens)
    )
    # bytes of num_blocks blocks of every layer, less the windowed group's, all to the full layers
    full_blocks = (num_blocks * n_layers - win_blocks * n_win) // n_full
    return KVLayout(
        (KVGroupSpec(full_blocks), KVGroupSpec(win_blocks, widest)),
        tuple(0 if w is None else 1 for w in layer_windows),
    )
