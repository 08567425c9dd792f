"""Exact block ids from the pool and the KV cache manager: allocation, sharing, eviction, ref counts."""

from __future__ import annotations

import pytest

from server.core.block_pool import BlockPool, hash_block_tokens
from server.core.kv_cache_manager import KVCacheManager
from server.request import Request, SamplingParams


def make_req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_pool_allocates_in_order_and_frees_to_tail() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) is None  # only 2 left: nothing taken
    assert pool.num_free_blocks == 2
    pool.free([1, 0])
    # free list order is now 2, 3, 1, 0
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert pool.usage == 1.0


def test_pool_ref_counts_and_double_free() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1) or []
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 2
    pool.free([b])
    assert pool.num_free_blocks == 1  # still held once
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([b])


def test_pool_cached_block_revived_then_evicted_lru() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3) or []
    ha, hb = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free([c, b, a])  # free order: c, b, a
    assert pool.get_cached_block(ha) == a
    pool.touch([a])  # revive a: it leaves the free list with its contents
    assert pool.num_free_blocks == 2
    assert pool.allocate(1) == [c]  # c (uncached) first
    assert pool.allocate(1) == [b]  # then b is evicted: its hash is dropped
    assert pool.get_cached_block(hb) is None
    assert pool.get_cached_block(ha) == a


def test_hash_chain_depends_on_prefix() -> None:
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(h1, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])


def test_manager_allocates_blocks_as_tokens_grow() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    req = make_req("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == [0, 1, 2]  # 12 tokens still fit in 3 blocks
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [0, 1, 2, 3]
    kv.free("a")
    assert kv.pool.num_free_blocks == 8
    # freed tail first: 3, 2, 1, 0 after the 4 never-used blocks
    assert kv.pool.allocate(8) == [4, 5, 6, 7, 3, 2, 1, 0]


def test_manager_refuses_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    req = make_req("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.pool.num_free_blocks == 2
    assert kv.block_ids("a") == []


def test_prefix_sharing_and_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a).block_ids == []
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    b = make_req("b", [*list(range(8)), 99, 98, 97])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free("a")
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    kv.free("b")
    assert kv.pool.num_free_blocks == 10


def test_prefix_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    same = make_req("same", list(range(8)))
    hit = kv.get_computed_blocks(same)
    # 8 tokens = 2 full blocks, but the last token must be computed for logits: only 1 block is reused
    assert hit.block_ids == [0] and hit.num_tokens == 4


def test_cached_free_blocks_are_revived_after_the_owner_finished() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_req("a", [5, 6, 7, 8, 9])
    assert kv.allocate_slots(a, 5) == [0, 1, 2]
    kv.free("a")  # blocks 0 and 1 stay cached while free
    b = make_req("b", [5, 6, 7, 8, 1])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1]
    assert kv.allocate_slots(b, 1, hit) == [0, 1, 3]
    assert kv.pool.num_free_blocks == 1  # only block 2 is free


def test_eviction_drops_least_recently_freed_cached_block() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)  # blocks 0 (cached [1,2]), 1
    kv.free("a")  # free order: 2, 1, 0
    c = make_req("c", [7, 7, 7, 7, 7])
    assert kv.allocate_slots(c, 5) == [2, 1, 0]  # takes everything: block 0's hash is evicted last
    kv.free("c")
    again = make_req("again", [1, 2, 3])
    assert kv.get_computed_blocks(again).block_ids == []
