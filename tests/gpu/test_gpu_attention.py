"""Triton attention, compiled on a GPU, against the torch backend at real shapes.
Skipped without CUDA (tests/conftest.py skips the `gpu` marker)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(32, 8, 128), (28, 4, 128)]  # Llama-3-8B, Qwen-style: heads / kv heads x head_dim


def _backends():
    pytest.importorskip("triton")
    from replicas.attention.torch_backend import TorchAttentionBackend
    from replicas.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(), TorchAttentionBackend()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_decode_matches_torch_backend(num_heads, num_kv_heads, head_dim, block_size, batch_size):
    from loadtests.gpu.gpu_kernel_check import accuracy_seq_lens, build_decode_case
    triton_backend, torch_backend = _backends()
    seq_lens = accuracy_seq_lens(batch_size, block_size, seed=batch_size)
    q, k_cache, v_cache, meta = build_decode_case(seq_lens, num_heads, num_kv_heads, head_dim,
                                                  block_size, torch.bfloat16, "cuda")
    scale = head_dim ** -0.5
    out = triton_backend.forward(q, k_cache, v_cache, meta, scale)
    expected = torch_backend.forward(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    is_real = torch.tensor([n > 0 for n in seq_lens], device="cuda")
    torch.testing.assert_close(out.float()[is_real], expected[is_real], atol=2e-2, rtol=2e-2)
    assert bool((out[~is_real] == 0).all())


@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_fp32_is_exact_to_fp32_rounding(block_size):
    from loadtests.gpu.gpu_kernel_check import build_decode_case
    triton_backend, torch_backend = _backends()
    seq_lens = [1, block_size, block_size + 1, 3000, 0]
    q, k_cache, v_cache, meta = build_decode_case(seq_lens, 32, 8, 128, block_size,
                                                  torch.float32, "cuda")
    out = triton_backend.forward(q, k_cache, v_cache, meta, 128 ** -0.5)
    expected = torch_backend.forward(q, k_cache, v_cache, meta, 128 ** -0.5)
    torch.testing.assert_close(out[:-1], expected[:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kv_matches_torch_backend_and_skips_padded_rows(block_size):
    triton_backend, torch_backend = _backends()
    shape = (8, block_size, 8, 128)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(2, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(8 * block_size, device="cuda")[:64]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    torch_backend.store_kv(k, v, expected_k, expected_v, slots)
    triton_backend.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("prefill", ["triton", "sdpa"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_mixed_prefill_and_decode_match_torch_backend(block_size, prefill):
    from replicas.attention.base import AttentionMetadata
    from replicas.attention.triton_backend import TritonAttentionBackend
    _, torch_backend = _backends()
    triton_backend = TritonAttentionBackend(prefill=prefill)
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    # (cached, new) per prefill: a fresh prompt and a chunk after a cached prefix.
    prefills, decode_lens = [(0, 300), (517, 128)], [40, 1000, 0]
    context_lens = [c + n for c, n in prefills] + decode_lens
    max_blocks = -(-max(context_lens) // block_size)
    num_blocks = max_blocks * len(context_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").view(len(context_lens), max_blocks).int()
    num_prefill_tokens = sum(n for _, n in prefills)
    q = torch.randn(num_prefill_tokens + len(decode_lens), num_heads, head_dim,
                    device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((q.shape[0],), -1, device="cuda"), num_prefills=2,
        num_prefill_tokens=num_prefill_tokens, prefill_query_start_loc=[0, 300, 428],
        prefill_seq_lens=[300, 645], prefill_block_tables=tables[:2], num_decodes=3,
        decode_seq_lens=torch.tensor(decode_lens, device="cuda", dtype=torch.int32),
        decode_block_tables=tables[2:], max_decode_seq_len=1000)
    out = triton_backend.forward(q, k_cache, v_cache, meta, head_dim ** -0.5)
    expected = torch_backend.forward(q.float(), k_cache.float(), v_cache.float(), meta,
                                     head_dim ** -0.5)
    torch.testing.assert_close(out[:-1].float(), expected[:-1], atol=2e-2, rtol=2e-2)
    assert bool((out[-1] == 0).all())


def test_decode_replays_in_a_cuda_graph():
    """Captured once with static buffers, replayed after the lengths change."""
    from loadtests.gpu.gpu_kernel_check import build_decode_case
    from replicas.attention.triton_backend import TritonAttentionBackend
    _backends()
    seq_lens = [100, 17, 0, 600]
    q, k_cache, v_cache, meta = build_decode_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    backend = TritonAttentionBackend(num_kv_splits=4)  # fixed: graph shapes are static
    backend.forward(q, k_cache, v_cache, meta, 0.1)  # warm up: compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(q, k_cache, v_cache, meta, 0.1)
    meta.decode_seq_lens.copy_(torch.tensor([5, 600, 33, 0], dtype=torch.int32))
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    eager = backend.forward(q, k_cache, v_cache, meta, 0.1)
    assert torch.equal(static_out, eager)
