"""Paged KV block manager: pure Python, no torch.

A request owns a list of block ids (its block table); token position p lives in
block `block_ids[p // block_size]`, offset `p % block_size`. Blocks are reference
counted so that a table can be shared (a fork for n > 1, or a prefix later).
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_watermark_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: new prompts leave this many blocks free, so that running decodes
        # can grow without preempting right after an admission.
        self.num_watermark_blocks = num_watermark_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(block_ids))

    def can_allocate(self, num_tokens: int) -> bool:
        """Room for a new request's first `num_tokens` slots, above the watermark."""
        need = self.num_blocks_for(num_tokens)
        return self.num_free_blocks - need >= self.num_watermark_blocks

    def can_append(self, block_ids: list[int], num_tokens: int, num_lookahead: int = 0) -> bool:
        """Room to hold `num_tokens` + `num_lookahead` slots in this table."""
        return self.num_missing_blocks(block_ids, num_tokens + num_lookahead) <= self.num_free_blocks

    def allocate(self, block_ids: list[int], num_tokens: int) -> None:
        """Grow `block_ids` in place until it holds `num_tokens` slots."""
        missing = self.num_missing_blocks(block_ids, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, have {self.num_free_blocks}")
        for _ in range(missing):
            block_id = self._free_block_ids.popleft()
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
        for block_id in block_ids:
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free_block_ids.append(block_id)
        block_ids.clear()
