"""KVCacheManager with a sliding window (every layer windowed): blocks wholly before the window of every
later query go back to the pool, their table entries become NULL_BLOCK_ID, and prefix-cache hits neither
revive blocks out of the window nor find blocks another request has overwritten."""

from __future__ import annotations

import pytest

from server.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from server.request import Request, SamplingParams

BS, W = 4, 6


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64, temperature=0.0))


def _run_chunks(kv: KVCacheManager, req: Request, chunk: int) -> list[list[int]]:
    """Prefills req in chunks, returning the table after each."""
    tables = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        table = kv.allocate_slots(req, n)
        assert table is not None
        skipped = kv._num_skipped.get(req.request_id, 0)
        assert all(kv.pool.blocks[b].ref_cnt >= 1 for b in table[skipped:])  # held while in the table
        tables.append(list(table))
        req.num_computed_tokens += n
    return tables


def _live(kv: KVCacheManager) -> list[int]:
    return [b for rid, t in kv.req_to_blocks.items() for b in t[kv._num_skipped.get(rid, 0) :]]


def test_blocks_out_of_the_window_are_freed_as_the_request_grows() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=False, sliding_window=W)
    req = _req("a", list(range(1, 41)))  # 40 tokens, 10 blocks
    tables = _run_chunks(kv, req, 5)
    for i, table in enumerate(tables):
        start = 5 * i  # the chunk's first position: its query reads from start - W + 1 on
        skipped = max(0, start - W + 1) // BS
        assert table[:skipped] == [NULL_BLOCK_ID] * skipped
        held = table[skipped:]
        assert len(held) == len(set(held))
        # every block the chunk's queries read is a real one: positions start - W + 1 .. start + 4
        assert skipped * BS <= max(0, start - W + 1)
    # the window (6) plus a 5-token chunk span at most 4 blocks of 4
    assert 64 - kv.pool.num_free_blocks <= 4
    kv.free("a")
    assert kv.pool.num_free_blocks == 64  # no stand-in freed, no double free


def test_without_a_window_nothing_is_freed() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    _run_chunks(kv, _req("a", list(range(1, 41))), 5)
    assert 64 - kv.pool.num_free_blocks == 10


def test_a_prefix_hit_past_the_window_takes_only_the_window() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, sliding_window=W)
    prompt = list(range(1, 33))  # 8 blocks
    a = _req("a", prompt)
    _run_chunks(kv, a, 32)
    kv.free("a")
    assert kv.pool.num_free_blocks == 64
    b = _req("b", [*prompt, 99, 98])
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 32  # every block still cached
    table = kv.allocate_slots(b, 2, hit)
    assert table is not None
    skipped = (32 - W + 1) // BS  # 6 blocks before position 27 are read by nobody
    assert table[:skipped] == [NULL_BLOCK_ID] * skipped
    # the hit's blocks out of the window stay free (not revived); those inside are taken
    assert all(kv.pool.blocks[x].ref_cnt == 0 for x in hit.block_ids[:skipped])
    assert table[skipped:8] == hit.block_ids[skipped:]
    assert all(kv.pool.blocks[x].ref_cnt == 1 for x in table[skipped:])
    b.num_computed_tokens = 34
    kv.free("b")
    assert kv.pool.num_free_blocks == 64


def test_blocks_freed_by_the_window_and_reused_are_never_a_prefix_hit() -> None:
    """A's early blocks go back to the pool while A runs; B's allocation takes them (evicting their hashes),
    so C, with A's prompt, finds no stale prefix: its hit is A's last window, which A still holds."""
    kv = KVCacheManager(12, BS, enable_prefix_caching=True, sliding_window=W)
    prompt = list(range(1, 41))  # 10 blocks, more than fit besides B without freeing
    a = _req("a", prompt)
    _run_chunks(kv, a, 4)
    assert 12 - kv.pool.num_free_blocks <= 3
    b = _req("b", list(range(100, 132)))  # 8 blocks: its prefill in one chunk takes A's freed blocks
    assert kv.allocate_slots(b, 32) is not None
    c = _req("c", [*prompt, 7])
    hit = kv.get_computed_blocks(c)
    # only the blocks the hit's first query reads are real (vLLM's sliding-window hit): A's last window
    real = hit.block_ids[max(0, hit.num_tokens - W + 1) // BS :]
    assert NULL_BLOCK_ID not in real or kv.pool.blocks[NULL_BLOCK_ID].block_hash is not None
    assert not set(real) & set(kv.req_to_blocks["b"])
    table = kv.allocate_slots(c, c.num_tokens - hit.num_tokens, hit)
    if table is not None:
        # a block in several live tables is shared (A's last window, hit by C): one reference each
        live = _live(kv)
        assert all(kv.pool.blocks[x].ref_cnt == live.count(x) for x in set(live))
    for rid in ("a", "b", "c"):
        kv.free(rid)
    assert kv.pool.num_free_blocks == 12


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_window_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, BS, sliding_window=bad)  # type: ignore[arg-type]
