"""Per-request block tables on top of the BlockPool, with automatic prefix caching. No torch.

Layer groups (server/core/kv_groups.py): one BlockPool and one block table per request for each group
of layers; group 0 is full attention unless every layer is windowed. A request's tables all cover the
same token positions; `allocate_slots` takes blocks from every group or from none.

Sliding window (a group's `sliding_window` W): the query at position p reads keys p - W + 1 .. p, so
once a request has computed n tokens, no later query of that group's layers reads a block wholly before
position n - W + 1. Such blocks go back to the group's pool (as vLLM's SlidingWindowManager does) and
their table entries become NULL_BLOCK_ID, so a request holds about W / block_size + 1 blocks of that
group however long it grows.

Prefix hits (`get_computed_blocks`): the full group needs every block of the prefix cached, a windowed
group only the blocks the first uncomputed query reads (its last window); the hit is the longest prefix
every group can serve (vLLM's hybrid coordinator's common hit length)."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from server.core.kv_groups import KVGroupSpec, cdiv
from server.request import Request

__all__ = ["NULL_BLOCK_ID", "ComputedBlocks", "KVCacheManager", "cdiv"]

# The table entry of a block freed out of the window: a valid block index (bounds checks pass), which no
# attention backend reads (each starts at the window, or masks what lies before it) and no step writes
# (this step's tokens lie inside the window).
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class ComputedBlocks:
    """Blocks of a request's prefix found in the cache, and how many tokens they cover: `block_ids` in
    group 0, `group_block_ids[g - 1]` in group g >= 1 (NULL_BLOCK_ID where a windowed group's layers read
    nothing)."""

    block_ids: list[int]
    num_tokens: int
    group_block_ids: tuple[list[int], ...] = field(default=())

    def group(self, g: int) -> list[int]:
        return self.block_ids if g == 0 else self.group_block_ids[g - 1]


class _Group:
    """One layer group's pool and tables (module docstring)."""

    def __init__(self, spec: KVGroupSpec, block_size: int, caching: bool, record_events: bool) -> None:
        self.window = spec.sliding_window
        self.block_size = block_size
        self.pool = BlockPool(spec.num_blocks, enable_caching=caching, record_events=record_events)
        self.tables: dict[str, list[int]] = {}
        self.skipped: dict[str, int] = {}  # leading table entries that are NULL_BLOCK_ID

    def num_skippable(self, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on reads: wholly before num_computed - W + 1."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def hit_length(self, hashes: list[BlockHash], limit: int) -> int:
        """The most blocks e <= limit such that a request whose first e blocks are `hashes[:e]` finds
        every block its query at position e * block_size reads cached in this group."""
        cached = self.pool.get_cached_block
        if self.window is None:
            e = 0
            while e < limit and cached(hashes[e]) is not None:
                e += 1
            return e
        e = limit
        while e > 0:
            first = self.num_skippable(e * self.block_size)
            missing = [i for i in range(first, e) if cached(hashes[i]) is None]
            if not missing:
                return e
            e = missing[-1]  # any hit ending after a missing block needs it
        return 0

    def hit_blocks(self, hashes: list[BlockHash], e: int) -> list[int]:
        first = self.num_skippable(e * self.block_size)
        found = [self.pool.get_cached_block(h) for h in hashes[first:e]]
        assert all(b is not None for b in found)
        return [NULL_BLOCK_ID] * first + [b for b in found if b is not None]

    def release_out_of_window(self, rid: str, num_computed: int) -> list[int]:
        """Blocks this request holds that fell out of the window: back to the pool, tail first. Returns
        the table."""
        held = self.tables.get(rid, [])
        skipped = self.skipped.get(rid, 0)
        skip = max(skipped, self.num_skippable(num_computed))
        if skip > skipped and held:
            gone = held[skipped : min(skip, len(held))]
            self.pool.free(list(reversed(gone)))
            held = [NULL_BLOCK_ID] * (skipped + len(gone)) + held[skipped + len(gone) :]
            self.tables[rid] = held
            self.skipped[rid] = skipped + len(gone)
        return held

    def free(self, rid: str) -> None:
        blocks = self.tables.pop(rid, None)
        skipped = self.skipped.pop(rid, 0)
        if blocks:
            self.pool.free(list(reversed(blocks[skipped:])))

    def free_excess(self, rid: str, keep: int) -> None:
        held = self.tables.get(rid)
        if held and len(held) > keep:
            self.tables[rid] = held[:keep]
            self.pool.free(list(reversed(held[keep:])), reuse_first=True)


@dataclass
class _GroupPlan:
    """What allocate_slots will do in one group once every group can."""

    held: list[int]
    hit_skip: int  # leading hit entries not taken (out of the window): stand-ins in the table
    taken: list[int]  # hit blocks taken
    num_new: int  # fresh blocks
    num_revived: int  # taken blocks that are free now


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        sliding_window: int | None = None,
        groups: tuple[KVGroupSpec, ...] | None = None,
    ) -> None:
        """One group of `num_blocks` blocks with `sliding_window` (every layer's window, or None), or
        `groups` (kv_groups.plan_kv_layout; then num_blocks and sliding_window are ignored). Only group
        0 records KV events: a hit needs group 0's whole prefix, which the events describe."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if groups is None:
            groups = (KVGroupSpec(num_blocks, sliding_window),)
        if not groups:
            raise ValueError("groups must name at least one group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [
            _Group(spec, block_size, enable_prefix_caching, record_events and g == 0)
            for g, spec in enumerate(groups)
        ]
        self.sliding_window = groups[0].sliding_window  # group 0's window (Mistral: every layer's)
        self.pool = self.groups[0].pool
        self.req_to_blocks = self.groups[0].tables
        self._num_skipped = self.groups[0].skipped
        self._req_to_hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use (the one that limits admission)."""
        return max(g.pool.usage for g in self.groups)

    @property
    def all_free(self) -> bool:
        """Every group's every block is back in its pool."""
        return all(g.pool.num_free_blocks == g.pool.num_blocks for g in self.groups)

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def group_block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's tables of groups 1.. (group 0's is allocate_slots' result)."""
        return tuple(tuple(g.tables.get(request_id, ())) for g in self.groups[1:])

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = [request.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            # The chain starts from the adapter's identity, so each adapter (and the base) has its own cache.
            root = request.lora.cache_key if request.lora is not None else None
            hashes.append(hash_block_tokens(hashes[-1] if hashes else root, tokens))
        return hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of the request every group can serve, in whole blocks. At least one
        token is always left to compute, since the step must produce logits for the last one."""
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0, tuple([] for _ in self.groups[1:]))
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        e = max_blocks
        # A full group's hit holds for any shorter prefix and a windowed one is searched below e: one
        # pass per group until no group shortens it (vLLM's coordinator).
        while True:
            shorter = min(g.hit_length(hashes, e) for g in self.groups)
            if shorter == e:
                break
            e = shorter
        found = [g.hit_blocks(hashes, e) for g in self.groups]
        return ComputedBlocks(found[0], e * self.block_size, tuple(found[1:]))

    def num_skippable_blocks(self, num_computed: int) -> int:
        """Group 0's leading blocks no query from position `num_computed` on reads."""
        return self.groups[0].num_skippable(num_computed)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Make room for num_new_tokens more tokens after the computed ones (the request's
        num_computed_tokens, plus `computed` for a request being admitted) in every group. Returns group
        0's whole block table (the others: `group_block_ids`), or None when some group's pool cannot
        supply the blocks; then nothing changed but blocks already out of a window going back to their
        pool (no query reads them again)."""
        rid = request.request_id
        num_computed = request.num_computed_tokens + (computed.num_tokens if computed else 0)
        need_total = cdiv(num_computed + num_new_tokens, self.block_size)
        plans: list[_GroupPlan] = []
        for gi, g in enumerate(self.groups):
            held = g.release_out_of_window(rid, num_computed)
            hit = computed.group(gi) if computed else []
            skip = max(g.skipped.get(rid, 0), g.num_skippable(num_computed))
            # prefix-cache hits already out of the window are not taken (nor revived): stand-ins
            hit_skip = min(max(0, skip - len(held)), len(hit))
            taken = hit[hit_skip:]
            # Reviving a free cached block also takes it off the free list.
            revived = sum(1 for b in taken if g.pool.blocks[b].ref_cnt == 0)
            plans.append(_GroupPlan(held, hit_skip, taken, need_total - len(held) - len(hit), revived))
        if any(
            max(p.num_new, 0) + p.num_revived > g.pool.num_free_blocks
            for g, p in zip(self.groups, plans, strict=True)
        ):
            return None
        known = min(num_computed + num_new_tokens, request.num_tokens)
        num_full = known // self.block_size
        hashes = self._block_hashes(request, num_full) if self.enable_prefix_caching else []
        for g, p in zip(self.groups, plans, strict=True):
            held = p.held
            if computed is not None and (p.taken or p.hit_skip):
                g.pool.touch(p.taken)
                held = held + [NULL_BLOCK_ID] * p.hit_skip + p.taken
                if p.hit_skip:
                    g.skipped[rid] = g.skipped.get(rid, 0) + p.hit_skip
            if p.num_new > 0:
                new = g.pool.allocate(p.num_new)
                assert new is not None
                held = held + new
            g.tables[rid] = held
            if self.enable_prefix_caching:
                self._cache_full_blocks(g, request, held, hashes, num_full)
        return self.req_to_blocks[rid]

    def _cache_full_blocks(
        self, g: _Group, request: Request, held: list[int], hashes: list[BlockHash], num_full: int
    ) -> None:
        """Blocks whose tokens are all known (prompt or already sampled) become shareable. Their KV is
        written in this step's forward pass before any attention of that layer reads it."""
        bs = self.block_size
        for i in range(g.skipped.get(request.request_id, 0), num_full):  # a stand-in is no block of ours
            tokens: list[int] = []
            if g.pool.record_events and g.pool.blocks[held[i]].block_hash is None:
                # Only a block about to be registered needs its tokens (for the BlockStored event).
                tokens = [request.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            g.pool.cache_block(held[i], hashes[i], hashes[i - 1] if i else None, tokens)

    def free_excess(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens: those only rejected draft tokens
        used. They hold no cached hash (drafts are never hashed), so they go to the front of the free
        list and a later allocation reuses them before evicting any cached prefix block."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        for g in self.groups:
            g.free_excess(request.request_id, keep)

    def free(self, request_id: str) -> None:
        self._req_to_hashes.pop(request_id, None)
        for g in self.groups:
            g.free(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every group's cached hashes; False (nothing changed) while any block is held."""
        if not self.all_free:
            return False
        return all(g.pool.reset_prefix_cache() for g in self.groups)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """A request of num_tokens fits in every group's pool alone (a windowed group's needs are
        bounded by its window, but one prompt chunk may span the whole request)."""
        return all(cdiv(num_tokens, self.block_size) <= g.pool.num_blocks for g in self.groups[:1]) and all(
            min(cdiv(num_tokens, self.block_size), cdiv(g.window - 1, self.block_size) + 2)
            <= g.pool.num_blocks
            for g in self.groups[1:]
            if g.window is not None
        )
