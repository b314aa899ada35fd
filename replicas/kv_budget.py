"""What the KV budget must hold, and the block manager built over it.

The number of blocks comes from the model runner (it knows the bytes per block);
this module checks that the budget can hold one sequence of the longest length
the engine accepts, and sets the admission watermark. A budget too small for one
sequence would fail only when a long request arrives, so it fails at start-up.
"""
from __future__ import annotations

from replicas.block_manager import BlockManager
from replicas.config import EngineConfig


def blocks_per_sequence(max_model_len: int, num_scheduler_steps: int, block_size: int) -> int:
    """Blocks of the longest sequence: a full context plus a window's lookahead slots."""
    return -(-(max_model_len + num_scheduler_steps) // block_size)


def make_block_manager(num_blocks: int, config: EngineConfig, max_model_len: int) -> BlockManager:
    """Raises ValueError when `num_blocks` cannot hold one sequence of `max_model_len`."""
    max_seq_blocks = blocks_per_sequence(max_model_len, config.num_scheduler_steps, config.block_size)
    if num_blocks < max_seq_blocks:
        raise ValueError(f"KV budget of {num_blocks} blocks cannot hold one sequence of "
                         f"max_model_len {max_model_len} (needs {max_seq_blocks}): "
                         f"raise num_kv_blocks/kv_cache_gib or lower max_model_len")
    # NOTE: 1% of the blocks, but never more than one sequence's worth, is kept
    # free at admission so that running decodes can grow (BlockManager).
    return BlockManager(num_blocks, config.block_size,
                        num_watermark_blocks=min(num_blocks // 100, max_seq_blocks),
                        enable_caching=config.enable_prefix_caching)
