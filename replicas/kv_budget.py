"""The KV budget: how many blocks the cache gets, what they must hold, and the
block manager built over them.

`num_kv_blocks` sizes the cache from the settings and the model's shape (the
model runner allocates that many). `make_block_manager` checks that the budget
can hold one sequence of the longest length the engine accepts, and sets the
admission watermark. A budget too small for one sequence would fail only when a
long request arrives, so it fails at start-up.
"""
from __future__ import annotations

from replicas.block_manager import BlockManager
from replicas.config import EngineConfig
from replicas.models.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def blocks_per_sequence(max_model_len: int, num_scheduler_steps: int, block_size: int) -> int:
    """Blocks of the longest sequence: a full context plus a window's lookahead slots."""
    return -(-(max_model_len + num_scheduler_steps) // block_size)


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> int:
    """`num_kv_blocks` when set, else as many blocks as `kv_cache_gib` holds, but no
    more than `max_num_seqs` full-length sequences can use. `config.dtype` is the
    resolved one (not auto)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    mc = model_config
    per_block = 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim \
        * DTYPE_BYTES[config.dtype]
    budget = int(config.kv_cache_gib * 2**30) // per_block
    per_seq = blocks_per_sequence(max_model_len, config.num_scheduler_steps, config.block_size)
    return max(1, min(budget, per_seq * config.max_num_seqs))


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
