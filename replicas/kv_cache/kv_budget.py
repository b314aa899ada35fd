"""The KV budget: how many blocks the cache gets, what they must hold, and the
block manager built over them.

`num_kv_blocks` sizes the cache from the settings and the model's shape (the
model runner allocates that many): `num_kv_blocks` when set; else on CPU
`kv_cache_gib` (None: `cpu_kv_cache_bytes`, CPU_KV_CACHE_GIB but at most a share of
the host memory still available, replicas/kv_cache/host_memory.py, and at least a
floor); else on CUDA what
`gpu_memory_utilization` of the device's memory leaves after the peak the engine
reached without a KV cache (`DeviceMemory`, measured by replicas/kv_cache/memory_profile.py:
the weights, one forward at max_num_batched_tokens, and memory outside torch:
CUDA context, other processes) and after headroom for the sampler's
(max_num_seqs x vocab) temporaries, at most `kv_cache_gib` when that is set.
The rest of device memory (1 - gpu_memory_utilization) is for what comes after
the KV cache: decode CUDA graphs, fragmentation. In every case no more blocks
than max_num_seqs full-length sequences can use.

`make_block_manager` checks that the budget can hold one sequence of the longest
length the engine accepts, and sets the admission watermark. A budget too small
for one sequence would fail only when a long request arrives, so it fails at
start-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from replicas.kv_cache.block_manager import BlockManager
from replicas.config import (CPU_KV_CACHE_GIB, CPU_KV_CACHE_MEMORY_SHARE, CPU_KV_CACHE_MIN_GIB,
                             EngineConfig)
from replicas.models.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30
# Bytes per (row, vocabulary entry) kept free for one step's sampling, an upper
# bound: the sampler's (rows x vocab) tensors (penalty counts and masks, adjusted
# and scaled logits, probabilities, exponential noise, top-k/top-p and logprob
# temporaries; replicas/sampling/sampler.py) and the decode graphs' float32 logits buffer,
# allocated after the cache: 16 float32 temporaries.
SAMPLER_BYTES_PER_LOGIT = 64


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    """A GPU's memory as the KV budget sees it, measured before the cache exists."""
    total_bytes: int
    # the peak without a KV cache: weights, one profiling forward, memory outside torch
    peak_used_bytes: int


def blocks_per_sequence(max_model_len: int, num_scheduler_steps: int, block_size: int) -> int:
    """Blocks of the longest sequence: a full context plus a window's lookahead slots."""
    return -(-(max_model_len + num_scheduler_steps) // block_size)


def bytes_per_block(config: EngineConfig, model_config: ModelConfig) -> int:
    """K and V of one block in every layer, in the resolved dtype (not auto)."""
    mc = model_config
    return 2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim \
        * DTYPE_BYTES[config.dtype]


def sampler_headroom_bytes(max_num_seqs: int, vocab_size: int) -> int:
    return max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT


def gpu_kv_cache_bytes(memory: DeviceMemory, gpu_memory_utilization: float,
                       reserved_bytes: int) -> int:
    """What the utilization's share of device memory leaves for the KV cache after
    the measured peak and `reserved_bytes` (may be negative: nothing fits)."""
    return int(memory.total_bytes * gpu_memory_utilization) - memory.peak_used_bytes - reserved_bytes


def num_gpu_kv_blocks(memory: DeviceMemory, gpu_memory_utilization: float, block_bytes: int,
                      reserved_bytes: int = 0, cap_bytes: int | None = None) -> int:
    """KV blocks on a GPU: `gpu_kv_cache_bytes`, at most `cap_bytes` when set.

    Raises ValueError naming the numbers when not one block fits.
    """
    free_bytes = gpu_kv_cache_bytes(memory, gpu_memory_utilization, reserved_bytes)
    budget = free_bytes if cap_bytes is None else min(free_bytes, cap_bytes)
    if budget < block_bytes:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization "
            f"{gpu_memory_utilization:g} of {memory.total_bytes / GIB:.2f} GiB is "
            f"{memory.total_bytes * gpu_memory_utilization / GIB:.2f} GiB; the weights, a "
            f"forward of max_num_batched_tokens and memory outside torch peak at "
            f"{memory.peak_used_bytes / GIB:.2f} GiB and the sampler's headroom is "
            f"{reserved_bytes / GIB:.2f} GiB, leaving {free_bytes / GIB:.2f} GiB"
            + (f" (kv_cache_gib caps it at {cap_bytes / GIB:.2f} GiB)" if cap_bytes is not None else "")
            + f" for blocks of {block_bytes / 2**20:.2f} MiB: raise gpu_memory_utilization, "
            f"lower max_num_batched_tokens or max_num_seqs, or use a GPU with more memory")
    return budget // block_bytes


def cpu_kv_cache_bytes(available_bytes: int | None) -> int:
    """The CPU cache when kv_cache_gib is None: CPU_KV_CACHE_GIB, but no more than
    CPU_KV_CACHE_MEMORY_SHARE of `available_bytes` (the host memory still free at
    start-up; None: unknown), and no less than CPU_KV_CACHE_MIN_GIB (the default
    before, which fits the machines we serve on: a share of a full machine's memory
    would otherwise leave no cache at all).

    NOTE: replicas of a node that start together each see the same free memory, so
    N of them may take N shares: past three engine replicas on a node, set
    kv_cache_gib."""
    default = int(CPU_KV_CACHE_GIB * GIB)
    if available_bytes is None:
        return default
    return max(int(CPU_KV_CACHE_MIN_GIB * GIB),
               min(default, int(available_bytes * CPU_KV_CACHE_MEMORY_SHARE)))


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  device_memory: DeviceMemory | None = None,
                  host_available_bytes: int | None = None) -> int:
    """`num_kv_blocks` when set; else the GPU budget when `device_memory` is given
    (CUDA), or as many blocks as `kv_cache_gib` holds (CPU; None:
    `cpu_kv_cache_bytes(host_available_bytes)`); but no more than `max_num_seqs`
    full-length sequences can use. `config.dtype` is the resolved one (not auto)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = bytes_per_block(config, model_config)
    cap_bytes = int(config.kv_cache_gib * GIB) if config.kv_cache_gib is not None else None
    if device_memory is not None:
        budget = num_gpu_kv_blocks(device_memory, config.gpu_memory_utilization, block_bytes,
                                   sampler_headroom_bytes(config.max_num_seqs, model_config.vocab_size),
                                   cap_bytes)
    else:
        budget = (cap_bytes if cap_bytes is not None
                  else cpu_kv_cache_bytes(host_available_bytes)) // block_bytes
    per_seq = blocks_per_sequence(max_model_len, config.num_scheduler_steps, config.block_size)
    return max(1, min(budget, per_seq * config.max_num_seqs))


def make_block_manager(num_blocks: int, config: EngineConfig, max_model_len: int) -> BlockManager:
    """Raises ValueError when `num_blocks` cannot hold one sequence of `max_model_len`."""
    max_seq_blocks = blocks_per_sequence(max_model_len, config.num_scheduler_steps, config.block_size)
    if num_blocks < max_seq_blocks:
        raise ValueError(f"KV budget of {num_blocks} blocks cannot hold one sequence of "
                         f"max_model_len {max_model_len} (needs {max_seq_blocks}): "
                         f"raise num_kv_blocks, kv_cache_gib or (on GPU) gpu_memory_utilization, "
                         f"or lower max_model_len")
    # NOTE: 1% of the blocks, but never more than one sequence's worth, is kept
    # free at admission so that running decodes can grow (BlockManager); with
    # nothing running the scheduler admits into it.
    return BlockManager(num_blocks, config.block_size,
                        num_watermark_blocks=min(num_blocks // 100, max_seq_blocks),
                        enable_caching=config.enable_prefix_caching)
