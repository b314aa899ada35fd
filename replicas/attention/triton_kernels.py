"""Triton kernels for the paged KV cache: store, split-KV decode, split merge,
and a causal prefill that reads its context (cached prefix included) from the cache.

KV layout (replicas/attention/base.py): per layer, `k_cache` and `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; the last dim is contiguous.

Decode is split-KV ("flash decoding"): one program per (sequence, KV head, split)
attends the WHOLE GQA group of query heads that share that KV head, so each K/V
tile is read from memory once per group rather than once per query head. Each
split writes a normalised partial output and its log-sum-exp (base 2); the merge
kernel combines the splits. A row whose seq_len is 0 (a padded row of a CUDA-graph
bucket) reads nothing and outputs zeros.

Every kernel also runs on CPU tensors under `TRITON_INTERPRET=1`, which must be
set before this module is imported (triton decides at decoration time).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOTE: tl.dot needs every tile dim >= 16 on GPU, so the GQA group is padded to 16
# query rows and token tiles are at least 16 long; other aranges are at least 2 long.
MIN_DOT_DIM = 16
MAX_NUM_KV_SPLITS = 16


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, KV_HEADS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    # NOTE: slot -1 (a padded row) masks every lane, so nothing is read or written.
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (slot >= 0)
    src_k = k_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :]
    src_v = v_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_tok
           + offs_h[:, None] * stride_cache_head + offs_d[None, :])
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    partial_out_ptr, partial_lse_ptr,
    scale_log2e,  # softmax scale * log2(e): the kernel works in base 2 (exp2)
    stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt_seq,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    is_real_head = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    # (GROUP_P2, HEAD_DIM): the query heads that share this KV head.
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=is_real_head[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head * stride_cache_head

    for tile in range(tile_start, tile_end):
        pos = tile * TILE_N + offs_n  # (TILE_N,) token positions in the sequence
        is_valid = pos < seq_len
        if BLOCK_SIZE >= TILE_N:
            # The whole tile lies inside one block (both are powers of two).
            block = tl.load(block_table_row + (tile * TILE_N) // BLOCK_SIZE).to(tl.int64)
        else:
            block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
        rows = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_tok + head_offset
        kv_offsets = rows[:, None] + offs_d[None, :]  # (TILE_N, HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offsets, mask=is_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        scores = tl.where(is_valid[None, :], scores, float("-inf"))  # (GROUP_P2, TILE_N)

        # Online softmax; every tile in range holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=is_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (short sequence, or seq_len 0) writes zeros and lse = -inf.
    has_tokens = l_i > 0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    po = (partial_out_ptr + seq * stride_po_seq + heads[:, None] * stride_po_head
          + split * stride_po_split + offs_d[None, :])
    tl.store(po, out, mask=is_real_head[:, None])
    pl = partial_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split
    tl.store(pl, lse, mask=is_real_head)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_out_seq, stride_out_head,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    is_split = offs_s < NUM_SPLITS
    lse = tl.load(partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + offs_s,
                  mask=is_split, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # NOTE: all splits empty (seq_len 0) -> every weight is exp2(-inf) = 0 -> output 0.
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weights, 0)
    parts = tl.load(partial_out_ptr + seq * stride_po_seq + head * stride_po_head
                    + offs_s[:, None] * stride_po_split + offs_d[None, :],
                    mask=is_split[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, scale_log2e,
    stride_q_tok, stride_q_head, stride_out_tok, stride_out_head,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    query_tile = tl.program_id(1)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    num_new_tokens = tl.load(query_start_loc_ptr + seq + 1) - query_start
    context_len = tl.load(seq_lens_ptr + seq)
    num_cached_tokens = context_len - num_new_tokens

    offs_m = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index among the new tokens
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    is_real_query = offs_m < num_new_tokens
    query_pos = num_cached_tokens + offs_m  # absolute position: causal with the cached prefix
    q = tl.load(q_ptr + (query_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head
                + offs_d[None, :], mask=is_real_query[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = (head // GROUP) * stride_cache_head
    # Keys this tile can see end at its last query's position; a tile past the end sees none.
    kv_end = tl.minimum(context_len, num_cached_tokens + (query_tile + 1) * BLOCK_M)
    kv_end = tl.where(query_tile * BLOCK_M < num_new_tokens, kv_end, 0)

    for kv_start in range(0, kv_end, BLOCK_N):
        pos = kv_start + offs_n
        is_valid = pos < context_len
        if BLOCK_SIZE >= BLOCK_N:
            block = tl.load(block_table_row + kv_start // BLOCK_SIZE).to(tl.int64)
        else:
            block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
        rows = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_tok + head_offset
        kv_offsets = rows[:, None] + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offsets, mask=is_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        visible = is_valid[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))  # (BLOCK_M, BLOCK_N)
        # NOTE: every row sees key 0 in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=is_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (query_start + offs_m)[:, None] * stride_out_tok + head * stride_out_head
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=is_real_query[:, None])


def _check_kv_layout(k_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.stride(-1) != 1:
        raise ValueError("KV cache must be [num_blocks, block_size, num_kv_heads, head_dim] "
                         "with a contiguous head_dim")
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if not _is_power_of_two(block_size) or not _is_power_of_two(head_dim):
        raise ValueError(f"block_size ({block_size}) and head_dim ({head_dim}) must be powers of two")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (T, num_kv_heads, head_dim) -> k_cache/v_cache at slot_mapping (T,); -1 skips."""
    _check_kv_layout(k_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_P2=max(2, triton.next_power_of_2(num_kv_heads)),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
    )


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_tokens: int,
                         target_num_programs: int = 264) -> int:
    """Splits so that num_seqs * num_kv_heads * splits fills the GPU (~2 programs per SM on
    an H100/H200), each split keeping at least 4 tiles of work; a power of two <= 16."""
    wanted = triton.cdiv(target_num_programs, max(1, num_seqs * num_kv_heads))
    useful = triton.cdiv(max(1, max_seq_len), 4 * tile_tokens)
    num_splits = max(1, min(wanted, useful, MAX_NUM_KV_SPLITS))
    return triton.next_power_of_2(num_splits)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor, num_kv_splits: int, tile_tokens: int = 64) -> torch.Tensor:
    """One decode token per sequence over the paged cache.

    q: (B, num_heads, head_dim); block_tables: (B, max_blocks) int32; seq_lens: (B,) int32
    (the current token included, 0 = padded row); out: (B, num_heads, head_dim), written.
    num_kv_splits must be a power of two (fixed per CUDA-graph bucket by the caller).
    """
    _check_kv_layout(k_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_seqs == 0:
        return out
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not _is_power_of_two(num_kv_splits) or not _is_power_of_two(tile_tokens):
        raise ValueError("num_kv_splits and tile_tokens must be powers of two")
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    tile_tokens = max(tile_tokens, MIN_DOT_DIM)
    # (B, num_heads, splits, head_dim) fp32 partial outputs and (B, num_heads, splits) lse.
    partial_out = torch.empty(num_seqs, num_heads, num_kv_splits, head_dim,
                              dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    # NOTE: fp32 caches would otherwise run the dots in tf32 on GPU (about 1e-3 error).
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial_out, partial_lse,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, GROUP_P2=max(MIN_DOT_DIM, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=tile_tokens, DOT_PRECISION=precision,
    )
    merge_splits(partial_out, partial_lse, out)
    return out


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """partial_out (B, H, S, D) fp32 + partial_lse (B, H, S) base-2 lse -> out (B, H, D)."""
    num_seqs, num_heads, num_splits, head_dim = partial_out.shape
    _merge_splits_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim,
    )


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor,
                  block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """Causal prefill over the paged cache (the new tokens' K/V already stored).

    q: (num_new_tokens, num_heads, head_dim), sequences back to back; query_start_loc:
    (num_seqs + 1,) int32 cumulative new-token counts; seq_lens: (num_seqs,) int32 context
    lengths (cached + new); block_tables: (num_seqs, max_blocks) int32; out like q, written.
    """
    _check_kv_layout(k_cache)
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    if num_seqs == 0 or max_query_len == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    block_m, block_n = max(block_m, MIN_DOT_DIM), max(block_n, MIN_DOT_DIM)
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=precision,
    )
    return out
