"""The profiling step that sizes the KV cache on CUDA (replicas/kv_cache/memory_profile.py):
its inputs are a valid step, and it runs on CPU. The measurement itself needs CUDA
(tests/gpu/test_gpu_engine.py). On CPU the cache itself is allocated lazily: zeros
that take memory only where written."""
import os

import pytest
import torch

from replicas.attention.torch_backend import TorchAttentionBackend
from replicas.config import EngineConfig
from replicas.kv_cache.memory_profile import profile_step_inputs, run_profile_step
from replicas.checkpoints.model_resolution import resolve_model
from replicas.models.loader import load_model

CPU = torch.device("cpu")


def test_profile_inputs_are_fresh_sequences_in_blocks_of_their_own():
    input_ids, positions, meta, logits_indices, num_blocks = profile_step_inputs(100, 3, 16, CPU)
    assert meta.prefill_seq_lens == [34, 33, 33] and meta.num_prefill_tokens == 100
    assert meta.prefill_query_start_loc == [0, 34, 67, 100]
    assert logits_indices.tolist() == [33, 66, 99]  # every sequence's last token is sampled
    assert positions.tolist() == list(range(34)) + list(range(33)) * 2
    assert num_blocks == 9  # 3 blocks each
    slots = meta.slot_mapping.tolist()
    assert len(set(slots)) == 100 and max(slots) < num_blocks * 16
    assert input_ids.shape == (100,)


@pytest.fixture(scope="module")
def tiny():
    resolved = resolve_model(EngineConfig(model="tiny", dtype="float32"))
    return resolved, load_model(resolved.model_dir, "float32", CPU, 512)


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens, max_model_len, rows, tokens", [
    (256, 64, 512, 64, 64),  # one token per sequence: the most rows of logits
    (4, 300, 512, 4, 300),
    (2, 2048, 100, 2, 198),  # no sequence past max_model_len - 1 tokens
])
def test_the_profile_step_runs_the_largest_step(tiny, max_num_seqs, max_num_batched_tokens,
                                               max_model_len, rows, tokens):
    resolved, model = tiny
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    mc = resolved.model_config
    logits, cache_bytes = run_profile_step(model, TorchAttentionBackend(), config, mc, CPU,
                                           max_model_len)
    assert logits.shape == (rows, mc.vocab_size) and bool(logits.isfinite().all())
    per_seq_blocks = -(-(tokens // rows + 1) // config.block_size)
    assert 0 < cache_bytes <= rows * per_seq_blocks * 2 * mc.num_layers * config.block_size \
        * mc.num_kv_heads * mc.head_dim * 4


def test_a_profiled_sequence_gets_the_logits_it_gets_alone(tiny):
    resolved, model = tiny
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=3, max_num_batched_tokens=100)
    mc, backend = resolved.model_config, TorchAttentionBackend()
    batched, _ = run_profile_step(model, backend, config, mc, CPU, 512)
    alone = EngineConfig(model="tiny", dtype="float32", max_num_seqs=1, max_num_batched_tokens=34)
    first, _ = run_profile_step(model, backend, alone, mc, CPU, 512)
    torch.testing.assert_close(batched[0], first[0], atol=1e-4, rtol=1e-4)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_kv_cache_reads_as_zeros_and_takes_memory_only_where_written(dtype):
    from replicas.kv_cache.memory_profile import allocate_kv_caches, zeroed_host_tensor

    shape = (4096, 16, 8, 64)  # 128 MiB in float32
    before = _rss_bytes()
    cache = zeroed_host_tensor(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0
    assert _rss_bytes() - before < 16 * 2**20  # not written at start-up
    cache[7, 3] = 1.5
    assert float(cache.sum()) == 1.5 * 8 * 64  # the rest reads as zeros
    assert float(cache[:7].abs().sum()) == 0.0
    assert _rss_bytes() - before < 16 * 2**20  # a page per written block, not the cache
    mc = resolve_model(EngineConfig(model="tiny", dtype="float32")).model_config
    kv = allocate_kv_caches(8, 16, mc, dtype, CPU)
    assert len(kv) == mc.num_layers
    assert all(float(k.abs().sum()) == 0.0 and float(v.abs().sum()) == 0.0 for k, v in kv)
