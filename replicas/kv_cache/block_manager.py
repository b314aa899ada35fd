"""Paged KV block manager with prefix caching: pure Python, no torch.

A request owns a list of block ids (its block table); token position p lives in
block `block_ids[p // block_size]`, offset `p % block_size`. Blocks are reference
counted so that a table can be shared (a fork for n > 1, or a cached prefix).

Prefix cache: a full block whose K/V is computed can be entered under the
chained hash of its tokens (replicas/kv_cache/block_hash.py); a later request with the
same leading blocks takes them instead of recomputing them. Only full blocks
are ever shared, and nobody writes into a full block again, so sharing needs no
copy-on-write. When its last holder frees it, a cached block keeps its content
and its hash, and becomes *evictable*: it still counts as free, but it is
reused (and leaves the cache) only when no plain free block is left, least
recently used first.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from replicas.kv_cache.block_hash import BlockHash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_watermark_blocks: int = 0,
                 enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: new prompts leave this many blocks free, so that running decodes
        # can grow without preempting right after an admission.
        self.num_watermark_blocks = num_watermark_blocks
        self.enable_caching = enable_caching
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # unreferenced, uncached
        self._ref_counts = [0] * num_blocks
        self._block_id_by_hash: dict[BlockHash, int] = {}
        self._hash_by_block_id: list[BlockHash | None] = [None] * num_blocks
        # Cached blocks nobody references, least recently used first.
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get: unreferenced ones, cached (evictable) or not."""
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, referenced or evictable."""
        return len(self._block_id_by_hash)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (evictable ones are not)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(block_ids))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_tokens: int, cached_block_ids: Sequence[int] = (),
                     keep_watermark: bool = True) -> bool:
        """Room for a new request's first `num_tokens` slots, above the watermark
        unless `keep_watermark` is False, when it takes `cached_block_ids` (from
        find_cached_blocks) as its first blocks."""
        # NOTE: an evictable hit leaves the free pool when taken; a held one costs nothing.
        need = (self.num_blocks_for(num_tokens) - len(cached_block_ids)
                + sum(1 for b in cached_block_ids if self._ref_counts[b] == 0))
        floor = self.num_watermark_blocks if keep_watermark else 0
        return self.num_free_blocks - need >= floor

    def can_append(self, block_ids: list[int], num_tokens: int, num_lookahead: int = 0) -> bool:
        """Room to hold `num_tokens` + `num_lookahead` slots in this table."""
        return self.num_missing_blocks(block_ids, num_tokens + num_lookahead) <= self.num_free_blocks

    def allocate(self, block_ids: list[int], num_tokens: int) -> None:
        """Grow `block_ids` in place until it holds `num_tokens` slots."""
        missing = self.num_missing_blocks(block_ids, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, have {self.num_free_blocks}")
        for _ in range(missing):
            block_id = self._pop_free_block()
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)

    def append_slots(self, block_ids: list[int], num_tokens: int, num_lookahead: int = 0) -> None:
        """Slots for the next `num_tokens` plus `num_lookahead` (multi-step) tokens."""
        self.allocate(block_ids, num_tokens + num_lookahead)

    def fork(self, block_ids: list[int]) -> list[int]:
        """A second table sharing the same blocks (reference counted)."""
        for block_id in block_ids:
            self._ref_counts[block_id] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; empties `block_ids` in place."""
        # NOTE: last block first, so that a sequence's tail is evicted before its
        # head (a chain is only reachable from its first block).
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count
            if count == 0:
                if self._hash_by_block_id[block_id] is None:
                    self._free_block_ids.append(block_id)
                else:
                    self._evictable_block_ids[block_id] = None
        block_ids.clear()

    def _pop_free_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable_block_ids.popitem(last=False)
        # NOTE: out of the map before its content is overwritten: no stale hit.
        del self._block_id_by_hash[self._hash_by_block_id[block_id]]
        self._hash_by_block_id[block_id] = None
        self.num_evicted_blocks += 1
        return block_id

    # -- prefix cache -----------------------------------------------------------
    def find_cached_blocks(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Block ids of the longest cached chain among the first `max_blocks` hashes."""
        hits: list[int] = []
        by_hash = self._block_id_by_hash
        for i in range(min(max_blocks, len(block_hashes))):
            block_id = by_hash.get(block_hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def take_cached_blocks(self, block_ids: list[int], cached_block_ids: Sequence[int]) -> None:
        """Start an empty table with cached blocks, one more reference each."""
        if block_ids:
            raise RuntimeError("cached blocks can only start an empty block table")
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable_block_ids[block_id]
            self._ref_counts[block_id] += 1
            block_ids.append(block_id)

    def cache_blocks(self, block_ids: list[int], block_hashes: Sequence[BlockHash],
                     start: int, stop: int) -> None:
        """Enter blocks [start, stop) of a table, full and computed, under their hashes."""
        by_hash, hash_by_id = self._block_id_by_hash, self._hash_by_block_id
        for i in range(start, stop):
            block_hash = block_hashes[i]
            if block_hash in by_hash:
                continue  # a hit, or the same tokens computed twice: the copy stays private
            block_id = block_ids[i]
            by_hash[block_hash] = block_id
            hash_by_id[block_id] = block_hash

    def check_consistent(self) -> None:
        """Raises AssertionError if the pool, the cache and the counts disagree (tests)."""
        free, evictable = set(self._free_block_ids), set(self._evictable_block_ids)
        assert len(free) == len(self._free_block_ids) and not free & evictable
        for block_id, count in enumerate(self._ref_counts):
            cached = self._hash_by_block_id[block_id] is not None
            assert count >= 0
            assert (count == 0) == (block_id in free or block_id in evictable), block_id
            assert block_id not in evictable or cached, block_id
            assert block_id not in free or not cached, block_id
        assert len(self._block_id_by_hash) == sum(h is not None for h in self._hash_by_block_id)
        for block_hash, block_id in self._block_id_by_hash.items():
            assert self._hash_by_block_id[block_id] == block_hash
