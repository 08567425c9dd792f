"""The pool of KV-cache blocks: free list, reference counts and the prefix-cache hash map. No torch.

Contract:
- A block is either held (ref_cnt > 0) or free (ref_cnt == 0, in the free queue).
- A free block may still carry a hash: its contents are valid and a later request may revive it
  (`touch`). `allocate` takes free blocks least-recently-freed first and drops their hash, which is
  how cached blocks are evicted (LRU).
- With `record_events`, every change to the set of cached hashes is appended to `events` (a block
  cached, cached blocks evicted, all cleared), in order; the engine drains them after each step
  (`take_events`) and hands them to the KV-event publisher (server/kv_events.py). The pool itself
  only keeps a list: no I/O, no threads.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of a full block: equal hashes mean equal tokens from the sequence start."""
    h = hashlib.sha256(parent or b"")
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


@dataclass
class BlockStoredEvent:
    """Blocks newly registered in the prefix cache: a run of consecutive full blocks of one sequence.

    block_hashes[i] chains on block_hashes[i - 1] (and block_hashes[0] on parent_block_hash, None for
    a sequence's first block); token_ids holds len(block_hashes) * block_size token ids, in order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


@dataclass
class BlockRemovedEvent:
    """Cached blocks evicted (their hash no longer resolves to a block)."""

    block_hashes: list[BlockHash]


@dataclass
class AllBlocksClearedEvent:
    """Every cached hash was forgotten (prefix-cache reset)."""


KVCacheEvent = BlockStoredEvent | BlockRemovedEvent | AllBlocksClearedEvent


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first entry is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.record_events = record_events
        self.events: list[KVCacheEvent] = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (empty unless record_events)."""
        out, self.events = self.events, []
        return out

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref_cnt 1, no hash), or None if fewer than n are free."""
        if n > len(self._free):
            return None
        out: list[int] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                # Evicting: the cached contents are about to be overwritten.
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                    evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        if evicted and self.record_events:
            self.events.append(BlockRemovedEvent(evicted))
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on blocks found in the prefix cache, reviving them if they were free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int], reuse_first: bool = False) -> None:
        """Drop one reference on each block. Callers pass a sequence's blocks tail first, so that the
        tail (least likely to be shared) is evicted before the prefix. reuse_first puts blocks without
        a hash at the front of the free list (their contents are worthless; reuse them before evicting)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if reuse_first and block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash | None = None,
        token_ids: Sequence[int] = (),
    ) -> bool:
        """Register a full, held block under its chained hash; True if it was newly registered. A hash
        already cached keeps its block. parent_hash and token_ids (the block's tokens) only feed the
        BlockStored event; a block that chains on the previous event's last hash extends that event."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        assert block.ref_cnt > 0
        if block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        if self.record_events:
            last = self.events[-1] if self.events else None
            if (
                isinstance(last, BlockStoredEvent)
                and parent_hash is not None
                and last.block_hashes[-1] == parent_hash
                and last.block_size == len(token_ids)
            ):
                last.block_hashes.append(block_hash)
                last.token_ids.extend(token_ids)
            else:
                self.events.append(
                    BlockStoredEvent([block_hash], parent_hash, list(token_ids), len(token_ids))
                )
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only safe when no block is held."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.record_events:
            self.events.append(AllBlocksClearedEvent())
        return True
