"""Triton attention kernels under the interpreter (CPU) against a loop reference and
the torch backend: GQA, block sizes 16 and 256, padded rows, block-crossing lengths."""
import pytest
import torch

from triton_interpreter import interpreted

triton_kernels = interpreted("replicas.attention.triton_kernels", "tests/gpu/test_gpu_attention.py")

from replicas.attention.base import AttentionMetadata  # noqa: E402
from replicas.attention.triton_backend import TritonAttentionBackend  # noqa: E402

SCALE = 0.3


def reference_attention(q, k_cache, v_cache, block_table, context_len, num_new_tokens):
    """Loop reference for one sequence: q (n, H, D) are its last n tokens, causal."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for j in range(num_new_tokens):
        visible = context_len - num_new_tokens + j + 1
        pos = torch.arange(visible)
        blocks = block_table[pos // block_size].long()
        k = k_cache[blocks, pos % block_size]  # (visible, kv_heads, D)
        v = v_cache[blocks, pos % block_size]
        for h in range(q.shape[1]):
            probs = torch.softmax((k[:, h // group] @ q[j, h]) * SCALE, dim=0)
            out[j, h] = probs @ v[:, h // group]
    return out


def build_case(prefills, decode_lens, block_size, num_heads=4, num_kv_heads=2, head_dim=16,
               seed=0):
    """prefills: [(num_cached, num_new)]; decode_lens: context lengths, 0 = padded row.
    Fills the cache at random, block tables from a random permutation of the blocks."""
    gen = torch.Generator().manual_seed(seed)
    all_lens = [c + n for c, n in prefills] + list(decode_lens)
    max_blocks = max(1, max(-(-n // block_size) for n in all_lens))
    num_blocks = max_blocks * len(all_lens) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:max_blocks * len(all_lens)]
    tables = tables.view(len(all_lens), max_blocks).int()
    num_prefill_tokens = sum(n for _, n in prefills)
    q = torch.randn(num_prefill_tokens + len(decode_lens), num_heads, head_dim, generator=gen)
    starts = [0]
    for _, n in prefills:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64),
        num_prefills=len(prefills), num_prefill_tokens=num_prefill_tokens,
        prefill_query_start_loc=starts, prefill_seq_lens=[c + n for c, n in prefills],
        prefill_block_tables=tables[:len(prefills)] if prefills else None,
        num_decodes=len(decode_lens),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32) if decode_lens else None,
        decode_block_tables=tables[len(prefills):] if decode_lens else None,
        max_decode_seq_len=max(decode_lens, default=0),
    )
    return q, k_cache, v_cache, meta


def reference_forward(q, k_cache, v_cache, meta):
    out = torch.zeros_like(q)
    for i in range(meta.num_prefills):
        start, end = meta.prefill_query_start_loc[i], meta.prefill_query_start_loc[i + 1]
        out[start:end] = reference_attention(q[start:end], k_cache, v_cache,
                                             meta.prefill_block_tables[i],
                                             meta.prefill_seq_lens[i], end - start)
    for b in range(meta.num_decodes):
        row = meta.num_prefill_tokens + b
        seq_len = int(meta.decode_seq_lens[b])
        if seq_len:
            out[row:row + 1] = reference_attention(q[row:row + 1], k_cache, v_cache,
                                                   meta.decode_block_tables[b], seq_len, 1)
    return out


@pytest.mark.parametrize("block_size,num_kv_heads", [(16, 2), (256, 1), (16, 3)])
def test_store_kv_matches_index_copy_and_skips_padded_slots(block_size, num_kv_heads):
    num_blocks, head_dim = 3, 16
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    # k and v as strided views into one fused tensor, as a fused QKV projection leaves them.
    kv = torch.randn(6, 2, num_kv_heads, head_dim)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([5, -1, block_size + 3, 2 * block_size + block_size - 1, -1, 0])
    triton_kernels.store_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], k[keep])
    expected_v.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], v[keep])
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("block_size,tile_tokens,decode_lens", [
    (16, 32, [37]),  # tile spans 2 blocks: per-token block lookup
    (16, 16, [1, 16, 17, 0, 45]),  # lengths at and across block edges, one padded row
    (256, 16, [300]),  # crosses a 256-token block
    (256, 32, [5, 0, 257, 31, 64]),
])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_paged_decode_matches_reference(block_size, tile_tokens, decode_lens, num_kv_splits):
    q, k_cache, v_cache, meta = build_case([], decode_lens, block_size)
    out = torch.full_like(q, float("nan"))
    triton_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                meta.decode_seq_lens, SCALE, out, num_kv_splits, tile_tokens)
    expected = reference_forward(q, k_cache, v_cache, meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for b, seq_len in enumerate(decode_lens):
        if seq_len == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1), (6, 2)])
def test_paged_decode_gqa_groups(num_heads, num_kv_heads):
    """MHA, a group of 8 on one KV head, and a group (3) that is not a power of two."""
    q, k_cache, v_cache, meta = build_case([], [20, 3], 16, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, head_dim=32)
    out = torch.empty_like(q)
    triton_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                meta.decode_seq_lens, SCALE, out, 2, 16)
    torch.testing.assert_close(out, reference_forward(q, k_cache, v_cache, meta),
                               atol=1e-5, rtol=1e-5)


def test_paged_decode_half_precision_cache():
    # NOTE: fp16, not bf16: triton 3.7's interpreter multiplies bf16 tiles as raw bits;
    # bf16 is covered compiled, in tests/gpu/test_gpu_attention.py.
    q, k_cache, v_cache, meta = build_case([], [40, 0, 9], 16, head_dim=32)
    q, k_cache, v_cache = q.half(), k_cache.half(), v_cache.half()
    out = torch.empty_like(q)
    triton_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                meta.decode_seq_lens, SCALE, out, 2, 16)
    assert out.dtype == torch.float16
    expected = reference_forward(q.float(), k_cache.float(), v_cache.float(), meta)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("prefill", ["triton", "sdpa"])
def test_backend_forward_mixed_batch_matches_reference_and_torch_backend(prefill):
    # Prefill without a cached prefix, prefill with one (chunked), then decodes + a pad.
    prefills = [(0, 5), (20, 7)]
    decode_lens = [19, 0, 33]
    q, k_cache, v_cache, meta = build_case(prefills, decode_lens, 16, seed=1)
    backend = TritonAttentionBackend(tile_tokens=16, prefill=prefill)
    out = backend.forward(q, k_cache, v_cache, meta, SCALE)
    expected = reference_forward(q, k_cache, v_cache, meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    pad_row = meta.num_prefill_tokens + 1
    assert torch.equal(out[pad_row], torch.zeros_like(out[pad_row]))
    torch_backend = pytest.importorskip("replicas.attention.torch_backend")
    real_rows = [r for r in range(q.shape[0]) if r != pad_row]
    torch_out = torch_backend.TorchAttentionBackend().forward(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out[real_rows], torch_out[real_rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,tile_tokens,prefills", [
    (16, 32, [(0, 40), (13, 20)]),  # query and key tiles span two blocks
    (256, 16, [(250, 20), (0, 3), (0, 33)]),  # chunk crosses a 256-token block; several tiles
])
def test_paged_prefill_kernel_matches_reference(block_size, tile_tokens, prefills):
    q, k_cache, v_cache, meta = build_case(prefills, [], block_size, seed=3)
    out = torch.full_like(q, float("nan"))
    starts = meta.prefill_query_start_loc
    triton_kernels.paged_prefill(
        q, k_cache, v_cache, meta.prefill_block_tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(meta.prefill_seq_lens, dtype=torch.int32),
        max(n for _, n in prefills), SCALE, out, tile_tokens, tile_tokens)
    torch.testing.assert_close(out, reference_forward(q, k_cache, v_cache, meta),
                               atol=1e-5, rtol=1e-5)


def test_backend_store_then_decode_round_trip():
    """store_kv writes the new token where decode reads it; padded rows write nothing."""
    q, k_cache, v_cache, meta = build_case([], [18, 0], 16, seed=2)
    new_k, new_v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    table = meta.decode_block_tables
    last_slot = int(table[0, 17 // 16]) * 16 + 17 % 16
    meta.slot_mapping = torch.tensor([last_slot, -1])
    before = k_cache.clone()
    backend = TritonAttentionBackend(tile_tokens=16)
    backend.store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    changed = (k_cache != before).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[last_slot // 16, last_slot % 16]]
    out = backend.forward(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out, reference_forward(q, k_cache, v_cache, meta),
                               atol=1e-5, rtol=1e-5)


def test_split_count_is_a_bounded_power_of_two():
    for num_seqs in (1, 5, 64, 256):
        for max_seq_len in (0, 1, 100, 4096, 100_000):
            n = triton_kernels.choose_num_kv_splits(num_seqs, 8, max_seq_len, 64)
            assert 1 <= n <= triton_kernels.MAX_NUM_KV_SPLITS and n & (n - 1) == 0
    assert triton_kernels.choose_num_kv_splits(64, 8, 4096, 64) == 1  # already fills the GPU
    assert triton_kernels.choose_num_kv_splits(1, 8, 4096, 64) == 16  # one long sequence


def test_rejects_non_power_of_two_head_dim():
    k_cache = torch.zeros(2, 16, 1, 24)
    with pytest.raises(ValueError, match="power"):
        triton_kernels.store_kv(torch.zeros(1, 1, 24), torch.zeros(1, 1, 24), k_cache,
                                k_cache.clone(), torch.tensor([0]))
