"""Triton attention backend: Triton KV store, split-KV paged decode and paged causal
prefill; `prefill="sdpa"` runs prefill through torch's scaled_dot_product_attention
instead (one call per sequence, its context gathered from the paged cache).

Same KV layout and metadata as every backend (replicas/attention/base.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from replicas.attention import triton_kernels
from replicas.attention.base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, tile_tokens: int = 64, num_kv_splits: int | None = None,
                 prefill: str = "triton") -> None:
        # tile_tokens: KV tokens (and prefill queries) per kernel tile, a power of two >= 16.
        # num_kv_splits: fixed split count (a power of two), e.g. while capturing CUDA graphs;
        # None picks one per call from the batch shape and max_decode_seq_len.
        if prefill not in ("triton", "sdpa"):
            raise ValueError(f"prefill must be 'triton' or 'sdpa', not {prefill!r}")
        self.tile_tokens = tile_tokens
        self.num_kv_splits = num_kv_splits
        self.prefill = prefill
        # Device copies of the prefill lists, built once per step (forward runs per layer).
        self._prefill_key: tuple | None = None
        self._prefill_tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        triton_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)  # (T, num_heads, head_dim)
        if meta.num_prefills and self.prefill == "triton":
            self._prefill_triton(q, k_cache, v_cache, meta, scale, out)
        elif meta.num_prefills:
            self._prefill_sdpa(q, k_cache, v_cache, meta, scale, out)
        if meta.num_decodes:
            self._decode(q, k_cache, v_cache, meta, scale, out)
        return out

    def kv_splits_for(self, num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        return triton_kernels.choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len,
                                                   self.tile_tokens)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        start = meta.num_prefill_tokens
        end = start + meta.num_decodes
        num_kv_splits = self.kv_splits_for(meta.num_decodes, k_cache.shape[2],
                                           meta.max_decode_seq_len)
        triton_kernels.paged_decode(q[start:end], k_cache, v_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, scale, out[start:end],
                                    num_kv_splits, self.tile_tokens)

    def _prefill_triton(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        # NOTE: keyed by value, not by the metadata object, which a runner may reuse.
        key = (q.device, tuple(meta.prefill_query_start_loc), tuple(meta.prefill_seq_lens))
        if key != self._prefill_key:
            self._prefill_key = key
            self._prefill_tensors = (
                torch.tensor(meta.prefill_query_start_loc, dtype=torch.int32, device=q.device),
                torch.tensor(meta.prefill_seq_lens, dtype=torch.int32, device=q.device))
        query_start_loc, seq_lens = self._prefill_tensors
        starts = meta.prefill_query_start_loc
        max_query_len = max(starts[i + 1] - starts[i] for i in range(meta.num_prefills))
        num_tokens = meta.num_prefill_tokens
        triton_kernels.paged_prefill(q[:num_tokens], k_cache, v_cache, meta.prefill_block_tables,
                                     query_start_loc, seq_lens, max_query_len, scale,
                                     out[:num_tokens], self.tile_tokens, self.tile_tokens)

    def _prefill_sdpa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        block_size = k_cache.shape[1]
        for i in range(meta.num_prefills):
            q_start, q_end = meta.prefill_query_start_loc[i], meta.prefill_query_start_loc[i + 1]
            num_new_tokens = q_end - q_start
            context_len = meta.prefill_seq_lens[i]
            num_cached_tokens = context_len - num_new_tokens
            # NOTE: store_kv ran first, so the whole context (cached prefix + new tokens)
            # is read back from the paged cache.
            positions = torch.arange(context_len, device=q.device)
            blocks = meta.prefill_block_tables[i, positions // block_size].long()
            offsets = positions % block_size
            k = k_cache[blocks, offsets].transpose(0, 1).unsqueeze(0)  # (1, kv_heads, ctx, D)
            v = v_cache[blocks, offsets].transpose(0, 1).unsqueeze(0)
            q_i = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # (1, heads, new, D)
            if num_cached_tokens == 0:
                attn = F.scaled_dot_product_attention(q_i, k.to(q.dtype), v.to(q.dtype),
                                                      is_causal=True, scale=scale,
                                                      enable_gqa=True)
            else:
                # Query j sits at position num_cached_tokens + j: bottom-right causal mask.
                query_positions = num_cached_tokens + torch.arange(num_new_tokens, device=q.device)
                mask = positions[None, :] <= query_positions[:, None]  # (new, ctx)
                attn = F.scaled_dot_product_attention(q_i, k.to(q.dtype), v.to(q.dtype),
                                                      attn_mask=mask, scale=scale,
                                                      enable_gqa=True)
            out[q_start:q_end] = attn.squeeze(0).transpose(0, 1)
