"""KV sizing: explicit blocks win, else the GiB budget, capped by what max_num_seqs can use."""
import pytest

from replicas.config import EngineConfig
from replicas.kv_budget import blocks_per_sequence, make_block_manager, num_kv_blocks
from replicas.models.model_config import ModelConfig

MC = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
                            "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2})


def test_explicit_blocks_win():
    assert num_kv_blocks(EngineConfig(dtype="float32", num_kv_blocks=77, kv_cache_gib=9.0), MC, 512) == 77


def test_the_gib_budget_in_the_resolved_dtype():
    # one block: 2 (K, V) x 2 layers x 16 slots x 2 kv heads x 16 dims x 4 bytes = 8 KiB
    config = EngineConfig(dtype="float32", kv_cache_gib=1 / 1024, max_num_seqs=4096)
    assert num_kv_blocks(config, MC, 512) == 128
    half = EngineConfig(dtype="bfloat16", kv_cache_gib=1 / 1024, max_num_seqs=4096)
    assert num_kv_blocks(half, MC, 512) == 256


def test_no_more_blocks_than_max_num_seqs_sequences_use():
    config = EngineConfig(dtype="float32", kv_cache_gib=8.0, max_num_seqs=3, num_scheduler_steps=8)
    assert num_kv_blocks(config, MC, 512) == 3 * blocks_per_sequence(512, 8, 16)


def test_a_budget_below_one_sequence_fails_at_start_up():
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        make_block_manager(10, EngineConfig(dtype="float32"), 512)
