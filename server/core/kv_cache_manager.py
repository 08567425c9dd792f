"""Per-request block tables on top of the BlockPool, with automatic prefix caching. No torch.

Sliding window (`sliding_window` W, set only when every layer of the model has one, Mistral-style): the
query at position p reads keys p - W + 1 .. p, so once a request has computed n tokens, no later query
reads a block wholly before position n - W + 1. Such blocks go back to the pool (as vLLM's
SlidingWindowManager does) and their table entries become NULL_BLOCK_ID, so a request holds about
W / block_size + 1 blocks however long it grows. Models that interleave global layers keep the whole
table: one cache serves all layers (a per-layer-group cache is the follow-up)."""

from __future__ import annotations

from dataclasses import dataclass

from server.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from server.request import Request

# The table entry of a block freed out of the window: a valid block index (bounds checks pass), which no
# attention backend reads (each starts at the window, or masks what lies before it) and no step writes
# (this step's tokens lie inside the window).
NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ComputedBlocks:
    """Blocks of a request's prefix found in the cache, and how many tokens they cover."""

    block_ids: list[int]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: every layer's window W in tokens (module docstring), or None: whole tables."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self._num_skipped: dict[str, int] = {}  # leading table entries that are NULL_BLOCK_ID
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, record_events=record_events)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._req_to_hashes: dict[str, list[BlockHash]] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

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
        """The longest cached prefix of the request, in whole blocks. At least one token is always left
        to compute, since the step must produce logits for the last one."""
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        found: list[int] = []
        for h in hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(h)
            if block_id is None:
                break
            found.append(block_id)
        return ComputedBlocks(found, len(found) * self.block_size)

    def num_skippable_blocks(self, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on reads: wholly before num_computed - W + 1."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Make room for num_new_tokens more tokens after the computed ones (the request's
        num_computed_tokens, plus `computed` for a request being admitted). Returns the whole block
        table, or None when the pool cannot supply the blocks; then nothing changed but blocks already out
        of the sliding window going back to the pool (no query reads them again)."""
        rid = request.request_id
        held = self.req_to_blocks.get(rid, [])
        computed_ids = computed.block_ids if computed else []
        num_computed = request.num_computed_tokens + (computed.num_tokens if computed else 0)
        need_total = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = need_total - len(held) - len(computed_ids)
        skipped = self._num_skipped.get(rid, 0)
        skip = max(skipped, self.num_skippable_blocks(num_computed))
        if skip > skipped and held:
            # blocks this request holds that fell out of the window: back to the pool, tail first
            gone = held[skipped : min(skip, len(held))]
            self.pool.free(list(reversed(gone)))
            held = [NULL_BLOCK_ID] * (skipped + len(gone)) + held[skipped + len(gone) :]
            self.req_to_blocks[rid] = held
            self._num_skipped[rid] = skipped = skipped + len(gone)
        # prefix-cache hits already out of the window are not taken (nor revived): stand-ins in the table
        hit_skip = min(max(0, skip - len(held)), len(computed_ids))
        taken = computed_ids[hit_skip:]
        # Reviving a free cached block also takes it off the free list.
        num_revived = sum(1 for b in taken if self.pool.blocks[b].ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived > self.pool.num_free_blocks:
            return None
        if computed_ids:
            self.pool.touch(taken)
            held = held + [NULL_BLOCK_ID] * hit_skip + taken
            if hit_skip:
                self._num_skipped[rid] = skipped = skipped + hit_skip
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            assert new is not None
            held = held + new
        self.req_to_blocks[request.request_id] = held
        if self.enable_prefix_caching:
            # Blocks whose tokens are all known (prompt or already sampled) become shareable. Their KV
            # is written in this step's forward pass before any attention of that layer reads it.
            known = min(num_computed + num_new_tokens, request.num_tokens)
            num_full = known // self.block_size
            hashes = self._block_hashes(request, num_full)
            bs = self.block_size
            for i in range(skipped, num_full):  # a stand-in is no block of this request's
                tokens: list[int] = []
                if self.pool.record_events and self.pool.blocks[held[i]].block_hash is None:
                    # Only a block about to be registered needs its tokens (for the BlockStored event).
                    tokens = [request.token_at(j) for j in range(i * bs, (i + 1) * bs)]
                self.pool.cache_block(held[i], hashes[i], hashes[i - 1] if i else None, tokens)
        return held

    def free_excess(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens: those only rejected draft tokens
        used. They hold no cached hash (drafts are never hashed), so they go to the front of the free
        list and a later allocation reuses them before evicting any cached prefix block."""
        held = self.req_to_blocks.get(request.request_id)
        if not held:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(held) > keep:
            self.req_to_blocks[request.request_id] = held[:keep]
            self.pool.free(list(reversed(held[keep:])), reuse_first=True)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        self._req_to_hashes.pop(request_id, None)
        skipped = self._num_skipped.pop(request_id, 0)
        if blocks:
            self.pool.free(list(reversed(blocks[skipped:])))

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks
