"""KV sizing: explicit blocks win; on CPU the GiB budget (by default bounded by the memory
available); on CUDA the utilization's share of
device memory less the measured peak and the sampler's headroom, kv_cache_gib a cap; never
more than max_num_seqs sequences use."""
import pytest

from replicas.config import EngineConfig
from replicas.kv_cache.host_memory import (available_host_bytes, cgroup_available_bytes,
                                           meminfo_available_bytes, own_cgroup_paths, stat_value)
from replicas.kv_cache.kv_budget import (SAMPLER_BYTES_PER_LOGIT, DeviceMemory, blocks_per_sequence,
                                         cpu_kv_cache_bytes, make_block_manager, num_gpu_kv_blocks,
                                         num_kv_blocks)
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


# -- CUDA: the budget from device memory ----------------------------------------------
GIB = 2**30
# one block of MC in float32 (above): 8 KiB; sampler headroom per row: 100 x 64 bytes
BLOCK_BYTES = 8 * 1024


def test_cpu_keeps_four_gib_by_default_and_kv_cache_gib_when_set():
    default = EngineConfig(dtype="float32", max_num_seqs=4096)
    assert default.kv_cache_gib is None
    assert num_kv_blocks(default, MC, 4096) == num_kv_blocks(
        EngineConfig(dtype="float32", max_num_seqs=4096, kv_cache_gib=4.0), MC, 4096) == 4 * GIB // BLOCK_BYTES
    # kv_cache_gib is the user's word: the memory available does not shrink it
    assert num_kv_blocks(EngineConfig(dtype="float32", max_num_seqs=4096, kv_cache_gib=1.0), MC, 512,
                         host_available_bytes=GIB) == GIB // BLOCK_BYTES


def test_the_cpu_default_takes_at_most_a_quarter_of_the_memory_available_and_at_least_1_gib():
    assert cpu_kv_cache_bytes(None) == 4 * GIB
    assert cpu_kv_cache_bytes(64 * GIB) == 4 * GIB
    assert cpu_kv_cache_bytes(6 * GIB) == 6 * GIB // 4
    assert cpu_kv_cache_bytes(2 * GIB) == cpu_kv_cache_bytes(0) == GIB  # the old default
    default = EngineConfig(dtype="float32", max_num_seqs=4096)
    assert num_kv_blocks(default, MC, 4096, host_available_bytes=6 * GIB) == 6 * GIB // 4 // BLOCK_BYTES


def test_host_memory_is_the_smaller_of_the_machines_and_its_cgroups():
    assert meminfo_available_bytes("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    assert meminfo_available_bytes("MemTotal: 100 kB\n") is None
    assert cgroup_available_bytes(10 * GIB, 4 * GIB) == 6 * GIB
    # file cache the kernel would reclaim (weights just read) is not used memory
    assert cgroup_available_bytes(10 * GIB, 9 * GIB, reclaimable=5 * GIB) == 6 * GIB
    assert cgroup_available_bytes(2**63 - 4096, GIB) is None  # cgroup v1's "no limit"
    assert cgroup_available_bytes(None, GIB) is None  # cgroup v2's "max"
    assert cgroup_available_bytes(GIB, 2 * GIB) == 0
    stat = "anon 5\ninactive_file 4096\ntotal_inactive_file 8192\n"
    assert stat_value(stat, "inactive_file") == 4096 and stat_value(stat, "active_file") == 0
    assert own_cgroup_paths("12:memory:/a/b\n3:cpu,cpuacct:/c\n0::/user.slice/x\n") == (
        "/user.slice/x", "/a/b")
    assert own_cgroup_paths("4:cpu,memory:/k\n") == (None, "/k")
    available = available_host_bytes()
    assert available is None or available >= 0


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in \\(0, 1\\]"):
        EngineConfig(gpu_memory_utilization=value)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_the_gpu_budget_is_the_utilizations_share_less_the_peak_and_the_headroom():
    memory = DeviceMemory(total_bytes=10 * GIB, peak_used_bytes=3 * GIB)
    # 0.9 x 10 GiB - 3 GiB - 1 GiB = 5 GiB
    assert num_gpu_kv_blocks(memory, 0.9, BLOCK_BYTES, reserved_bytes=GIB) == 5 * GIB // BLOCK_BYTES
    # kv_cache_gib caps it; a cap above what is free does not raise it
    assert num_gpu_kv_blocks(memory, 0.9, BLOCK_BYTES, GIB, cap_bytes=2 * GIB) == 2 * GIB // BLOCK_BYTES
    assert num_gpu_kv_blocks(memory, 0.9, BLOCK_BYTES, GIB, cap_bytes=40 * GIB) == 5 * GIB // BLOCK_BYTES


def test_a_gpu_without_room_for_one_block_fails_naming_the_numbers():
    memory = DeviceMemory(total_bytes=16 * GIB, peak_used_bytes=15 * GIB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.9 of 16.00 GiB is 14.40 GiB.*"
                                         r"peak at 15.00 GiB.*raise gpu_memory_utilization"):
        num_gpu_kv_blocks(memory, 0.9, BLOCK_BYTES)


def test_on_a_gpu_num_kv_blocks_leaves_the_sampler_its_headroom_and_caps_by_sequences():
    memory = DeviceMemory(total_bytes=GIB, peak_used_bytes=GIB // 2)
    config = EngineConfig(dtype="float32", max_num_seqs=4096, gpu_memory_utilization=1.0)
    headroom = 4096 * MC.vocab_size * SAMPLER_BYTES_PER_LOGIT
    assert num_kv_blocks(config, MC, 512, memory) == (GIB // 2 - headroom) // BLOCK_BYTES
    few = EngineConfig(dtype="float32", max_num_seqs=3, gpu_memory_utilization=1.0)
    assert num_kv_blocks(few, MC, 512, memory) == 3 * blocks_per_sequence(512, 8, 16)
    capped = EngineConfig(dtype="float32", max_num_seqs=4096, kv_cache_gib=1 / 1024)
    assert num_kv_blocks(capped, MC, 512, memory) == 128
