"""KV layer groups (server/core/kv_groups.py): windowed layers beside global ones get their own pool and
block table; the windowed group's blocks behind the window go back to its pool while the full group keeps
the whole context; a prefix hit is what both groups can serve (vLLM's hybrid coordinator); no group leaks."""

from __future__ import annotations

import pytest

from server.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from server.core.kv_groups import (
    KVGroupSpec,
    KVLayout,
    plan_kv_layout,
    window_blocks_per_sequence,
    window_group_blocks,
)
from server.request import Request, SamplingParams

BS, W = 4, 6


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64, temperature=0.0))


def _kv(full: int = 64, win: int = 64, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(0, BS, caching, groups=(KVGroupSpec(full), KVGroupSpec(win, W)))


def _held(kv: KVCacheManager, g: int) -> int:
    pool = kv.groups[g].pool
    return pool.num_blocks - pool.num_free_blocks


def _prefill(kv: KVCacheManager, req: Request, chunk: int) -> list[tuple[int, int]]:
    """Prefills req in chunks; the blocks each group holds after each chunk's allocation."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        held.append((_held(kv, 0), _held(kv, 1)))
        req.num_computed_tokens += n
    return held


def test_plan_splits_the_budget_by_bytes() -> None:
    # one global and two windowed layers, 128 blocks of every layer (384 of one layer), 2 seats, 16-token
    # steps: the windowed group gets what 2 seqs can hold, 2 x (ceil(15 / 8) + 2) + ceil(16 / 8) = 10
    # blocks, where 2 sequences of 128 tokens (16 blocks) fit in the global layer's rest of the bytes
    assert window_group_blocks(16, 8, 2, 16) == 10
    layout = plan_kv_layout(
        [None, 16, 16], 384, 8, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128
    )
    assert layout.groups == (KVGroupSpec(384 - 10 * 2), KVGroupSpec(10, 16))
    assert layout.layer_group == (0, 1, 1)
    # 2 sequences of 8192 tokens (2 x 1024 blocks) do not fit: the windowed group keeps one sequence's
    # window and chunk (ceil(15 / 8) + 2 + 2 = 6 blocks), the global layer takes the rest
    assert window_blocks_per_sequence(16, 8, 16, 8192) == 6
    layout = plan_kv_layout([None, 16, 16], 384, 8, 2, 16, 8192)
    assert layout.groups == (KVGroupSpec(384 - 6 * 2), KVGroupSpec(6, 16))
    # never fewer blocks for the global layer than one pool of every layer would give (128)
    assert plan_kv_layout([None, 16, 16], 384, 8, 256, 2048, 8192).groups == (
        KVGroupSpec(128),
        KVGroupSpec(128, 16),
    )
    # one group where every layer is alike
    assert plan_kv_layout([None, None], 16, 8, 4, 16, 64) == KVLayout((KVGroupSpec(8),), (0, 0))
    assert plan_kv_layout([32, 16], 16, 8, 4, 16, 64) == KVLayout((KVGroupSpec(8, 32),), (0, 0))
    with pytest.raises(ValueError, match="at least one layer"):
        plan_kv_layout([], 8, 8, 4, 16, 64)
    with pytest.raises(ValueError, match="one block per layer"):
        plan_kv_layout([None, 16], 1, 8, 4, 16, 64)
    with pytest.raises(ValueError, match="sliding_window"):
        KVGroupSpec(8, 0)


def test_the_windowed_group_frees_behind_the_window_and_the_full_group_keeps_all() -> None:
    kv = _kv()
    req = _req("a", list(range(1, 41)))  # 40 tokens: 10 blocks
    held = _prefill(kv, req, 5)
    assert [f for f, _ in held] == [-(-min(5 * (i + 1), 40) // BS) for i in range(len(held))]
    # the window (6) plus a 5-token chunk span at most 4 blocks of 4, as Mistral's single group
    assert max(w for _, w in held) <= 4
    table0, (table1,) = kv.block_ids("a"), kv.group_block_ids("a")
    assert NULL_BLOCK_ID not in table0[1:] and len(table0) == len(table1) == 10
    skipped = (35 - W + 1) // BS  # the last chunk started at 35
    assert list(table1[:skipped]) == [NULL_BLOCK_ID] * skipped
    kv.free("a")
    assert kv.all_free


def test_all_or_nothing_across_groups() -> None:
    kv = _kv(full=64, win=3)  # the windowed pool cannot hold a 16-token chunk's 4 blocks
    req = _req("a", list(range(1, 41)))
    assert kv.allocate_slots(req, 16) is None
    assert kv.all_free and kv.block_ids("a") == [] and kv.group_block_ids("a") == ((),)
    assert kv.allocate_slots(req, 8) is not None
    assert (_held(kv, 0), _held(kv, 1)) == (2, 2)
    kv.free("a")
    assert kv.all_free


def test_a_prefix_hit_past_the_window_needs_only_the_windowed_groups_last_window() -> None:
    kv = _kv()
    prompt = list(range(1, 33))  # 8 blocks
    a = _req("a", prompt)
    _prefill(kv, a, 4)  # the windowed group keeps only the last blocks cached by a live table ...
    kv.free("a")
    assert kv.all_free
    b = _req("b", [*prompt, 99, 98])
    hit = kv.get_computed_blocks(b)
    # ... yet freed blocks keep their hash until reused: every block of both groups is still cached
    assert hit.num_tokens == 32
    first = (32 - W + 1) // BS  # the query at 32 reads from 27 on: block 6
    assert hit.group(1)[:first] == [NULL_BLOCK_ID] * first and NULL_BLOCK_ID not in hit.group(1)[first:]
    assert kv.allocate_slots(b, 2, hit) is not None
    assert kv.block_ids("b")[:8] == hit.block_ids
    assert kv.group_block_ids("b")[0][first:8] == tuple(hit.group(1)[first:])
    assert (_held(kv, 0), _held(kv, 1)) == (9, 3)  # 8 hit + 1 new; 2 hit in the window + 1 new
    b.num_computed_tokens = 34
    kv.free("b")
    assert kv.all_free


def test_the_common_hit_is_cut_where_the_windowed_group_lost_its_window() -> None:
    """The windowed group's pool is small: another request's allocation evicts the freed blocks of A's
    last window, so a later hit of A's prompt ends where the windowed group still has a whole window,
    though the full group has every block."""
    kv = _kv(full=64, win=6)
    prompt = list(range(1, 41))  # 10 blocks
    a = _req("a", prompt)
    _prefill(kv, a, 4)
    kv.free("a")
    # B's 3 windowed blocks come from the free list's front: the blocks A freed first (out of its window
    # early), not those of its last window, which went back last
    b = _req("b", list(range(100, 112)))
    assert kv.allocate_slots(b, 12) is not None
    c = _req("c", [*prompt, 7])
    hit = kv.get_computed_blocks(c)
    assert hit.num_tokens == 40  # A's last window (blocks 8, 9) survived: the whole prompt is a hit
    # now evict everything of A in the windowed group
    kv.free("b")
    d = _req("d", list(range(200, 224)))
    assert kv.allocate_slots(d, 24) is not None  # all 6 windowed blocks
    hit = kv.get_computed_blocks(c)
    assert hit.num_tokens == 0  # the full group has all 10 blocks, the windowed group no window of them
    e = _req("e", [*prompt[:4], 5])  # a hit of one block needs blocks 0..0 in the windowed group: gone too
    assert kv.get_computed_blocks(e).num_tokens == 0
    kv.free("d")
    assert kv.all_free


def test_abort_mid_prefill_and_excess_drafts_leak_nothing() -> None:
    kv = _kv()
    a = _req("a", list(range(1, 41)))
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    assert kv.allocate_slots(a, 12) is not None  # as if 12 tokens of drafts were scheduled
    a.num_computed_tokens = 26  # 2 accepted
    kv.free_excess(a)
    assert len(kv.block_ids("a")) == len(kv.group_block_ids("a")[0]) == 7
    kv.free("a")  # the abort
    assert kv.all_free


def test_prefix_cache_reset_forgets_every_group() -> None:
    kv = _kv()
    a = _req("a", list(range(1, 17)))
    _prefill(kv, a, 16)
    assert not kv.reset_prefix_cache()  # blocks held
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("b", list(range(1, 18)))).num_tokens == 0


def test_short_sequences_never_get_fewer_windowed_blocks_than_one_pool_gave() -> None:
    # Gemma-3-1B's layers (22 windowed of 512 tokens, 4 global) in 512 blocks of every layer, 64 seats,
    # 8,192-token context: one pool held 512 blocks in every layer, so 16 sequences of ~200 tokens (13
    # blocks each, as many in a windowed layer as in a global one below the window) ran without
    # preemption. The windowed group once got 168 blocks here (the budget split as full-length demands
    # do) and the quiet benchmark's 16 users were preempted.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = plan_kv_layout(windows, 512 * 26, 16, 64, 2048, 8192)
    full, win = layout.groups
    assert win.num_blocks >= 512 and full.num_blocks >= 512
    assert win.num_blocks >= 16 * 13
    # with room to spare the windowed group takes only what its 64 running windows can use
    layout = plan_kv_layout(windows, 4096 * 26, 16, 64, 2048, 8192)
    assert layout.groups[1].num_blocks == window_group_blocks(512, 16, 64, 2048)
    assert layout.groups[0].num_blocks == (4096 * 26 - 22 * layout.groups[1].num_blocks) // 4
