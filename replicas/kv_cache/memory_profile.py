"""The KV cache's tensors (`allocate_kv_caches`; on CPU zeros that take memory only
where written), and what a GPU has left for them: the peak the engine reaches before the
cache exists, measured once at start-up (replicas/kv_cache/kv_budget.py turns it into blocks).

The largest step the scheduler can make is `max_num_batched_tokens` prompt tokens
(no sequence longer than max_model_len - 1); its most sampled rows (the logits)
are min(max_num_seqs, those tokens). The profile
runs that step once, as fresh sequences of near-equal length, over a temporary KV
cache just large enough for it, and takes the cache's own bytes off the peak.
Memory outside torch's allocator (CUDA context, other processes) counts as used.
The profiling forward runs on any device (CPU tests check its inputs); only the
measurement needs CUDA.

NOTE: the step's sequences are short and fresh, so it does not measure one prompt
chunk attending over a long cached context. Flash-attn and our Triton kernels need
no temporaries that grow with that context; the plain torch backend does (a masked
(heads, chunk, context) score matrix per layer): with it on CUDA, lower
`gpu_memory_utilization` or set `kv_cache_gib`.
"""
from __future__ import annotations

import math
import mmap

import torch

from replicas.attention.base import AttentionBackend, AttentionMetadata
from replicas.config import EngineConfig
from replicas.kv_cache.kv_budget import DeviceMemory
from replicas.models.model_config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(num_blocks: int, block_size: int, model_config: ModelConfig,
                       dtype: torch.dtype, device: torch.device) -> KVCaches:
    """Per layer, K and V of shape (num_blocks, block_size, num_kv_heads, head_dim)."""
    mc = model_config
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    # NOTE: zeros, not empty: masked-out slots still meet the softmax weights,
    # and 0 * NaN garbage would poison the output.
    if device.type == "cpu":
        return [(zeroed_host_tensor(shape, dtype), zeroed_host_tensor(shape, dtype))
                for _ in range(mc.num_layers)]
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(mc.num_layers)]


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in host memory that costs nothing until it is used.

    Why not torch.zeros: it writes every byte at start-up, so the kernel faults in
    and clears every page of a cache sized for max_num_seqs full-length sequences
    (gigabytes), most of which a replica may never fill. An anonymous mapping reads
    as zeros by the kernel's guarantee and gets a page only where it is written. The
    tensor holds the mapping (torch.frombuffer keeps its buffer alive)."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def profile_step_inputs(num_tokens: int, num_seqs: int, block_size: int, device: torch.device):
    """(input_ids, positions, meta, logits_indices, num_blocks): `num_tokens` prompt
    tokens over `num_seqs` fresh sequences, each in blocks of its own and sampled."""
    base, extra = divmod(num_tokens, num_seqs)
    seq_lens = [base + (i < extra) for i in range(num_seqs)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq)
    tables, positions, slots, query_start = [], [], [], [0]
    next_block = 0
    for n, nb in zip(seq_lens, blocks_per_seq):
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table + [0] * (width - nb))
        positions += range(n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
        query_start.append(query_start[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_prefills=num_seqs, num_prefill_tokens=num_tokens,
        prefill_query_start_loc=query_start, prefill_seq_lens=seq_lens,
        prefill_block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        num_decodes=0, decode_seq_lens=None, decode_block_tables=None)
    return (torch.zeros(num_tokens, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device), meta,
            torch.tensor(query_start[1:], dtype=torch.int64, device=device) - 1, next_block)


@torch.inference_mode()
def run_profile_step(model: torch.nn.Module, backend: AttentionBackend, config: EngineConfig,
                     model_config: ModelConfig, device: torch.device,
                     max_model_len: int) -> tuple[torch.Tensor, int]:
    """Runs the largest step once; returns its (num_sampled, vocab) logits and the
    bytes of the temporary KV cache it ran over."""
    num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    # NOTE: a prompt chunk never passes max_model_len - 1 tokens (nor the rope tables)
    num_tokens = min(config.max_num_batched_tokens, num_seqs * max(1, max_model_len - 1))
    input_ids, positions, meta, logits_indices, num_blocks = profile_step_inputs(
        num_tokens, num_seqs, config.block_size, device)
    kv_caches = allocate_kv_caches(num_blocks, config.block_size, model_config,
                                   getattr(torch, config.dtype), device)
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in kv_caches)
    logits = model(input_ids, positions, kv_caches, meta, backend, logits_indices)
    return logits, cache_bytes


def profile_cuda_memory(model: torch.nn.Module, backend: AttentionBackend, config: EngineConfig,
                        model_config: ModelConfig, device: torch.device,
                        max_model_len: int) -> DeviceMemory:
    """The device's total memory and the peak used without a KV cache (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    logits, cache_bytes = run_profile_step(model, backend, config, model_config, device,
                                           max_model_len)
    torch.cuda.synchronize(device)
    del logits
    peak_torch_bytes = torch.cuda.max_memory_allocated(device) - cache_bytes
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    # NOTE: the CUDA context, libraries' own allocations and other processes
    outside_torch_bytes = max(0, total_bytes - free_bytes - torch.cuda.memory_reserved(device))
    # the profile's blocks go back to the device for the real KV cache
    torch.cuda.empty_cache()
    return DeviceMemory(total_bytes, peak_torch_bytes + outside_torch_bytes)
