"""flash-attn backend: flash-attn 2's paged API over our KV layout.

flash-attn's paged cache is exactly ours, `[num_blocks, block_size, num_kv_heads,
head_dim]`, with two limits of its own: fp16/bf16 only, and a block size that is a
multiple of 256. flash-attn is imported only when this backend is built.

Untested in CI (no flash-attn wheel, no GPU there); written against the documented
signatures of `flash_attn_varlen_func(..., block_table=)` and
`flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, block_table=)`.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from replicas.attention.base import AttentionBackend, AttentionMetadata

FLASH_ATTN_BLOCK_MULTIPLE = 256
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def check_flash_attn_supports(dtype: torch.dtype, block_size: int) -> None:
    """Raises ValueError saying why flash-attn's paged API cannot serve this config."""
    if dtype not in FLASH_ATTN_DTYPES:
        raise ValueError(f"flash-attn needs float16 or bfloat16, not {dtype}")
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn's paged KV cache needs a block size that is a multiple "
                         f"of {FLASH_ATTN_BLOCK_MULTIPLE}, not {block_size}")


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        # NOTE: the KV write is our Triton store kernel: triton ships with every CUDA
        # torch, it skips slot -1 without a host sync, and it is CUDA-graph safe.
        from replicas.attention.triton_kernels import store_kv

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._store_kv = store_kv

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        check_flash_attn_supports(k_cache.dtype, k_cache.shape[1])
        out = torch.empty_like(q)  # (T, num_heads, head_dim)
        if meta.num_prefills:
            self._prefill(q, k_cache, v_cache, meta, scale, out)
        if meta.num_decodes:
            start = meta.num_prefill_tokens
            end = start + meta.num_decodes
            # q as (B, 1, heads, D): one new token per sequence; the cache already holds it.
            decoded = self._with_kvcache(
                q[start:end].unsqueeze(1), k_cache, v_cache,
                cache_seqlens=meta.decode_seq_lens, block_table=meta.decode_block_tables,
                softmax_scale=scale, causal=True,
            ).squeeze(1)
            # Padded rows (seq_len 0) must read as zeros, whatever the kernel left there.
            is_real = (meta.decode_seq_lens > 0)[:, None, None]
            out[start:end] = torch.where(is_real, decoded, torch.zeros_like(decoded))
        return out

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        device = q.device
        query_start_loc = torch.tensor(meta.prefill_query_start_loc, dtype=torch.int32,
                                       device=device)
        cu_seq_lens = torch.tensor(list(accumulate(meta.prefill_seq_lens, initial=0)),
                                   dtype=torch.int32, device=device)
        query_lens = [meta.prefill_query_start_loc[i + 1] - meta.prefill_query_start_loc[i]
                      for i in range(meta.num_prefills)]
        num_tokens = meta.num_prefill_tokens
        # NOTE: with block_table, k/v are the paged caches and cu_seqlens_k counts context
        # (cached + new) tokens; causal=True aligns the mask bottom-right, which is exactly
        # chunked prefill over a cached prefix.
        out[:num_tokens] = self._varlen(
            q[:num_tokens], k_cache, v_cache,
            cu_seqlens_q=query_start_loc, cu_seqlens_k=cu_seq_lens,
            max_seqlen_q=max(query_lens), max_seqlen_k=max(meta.prefill_seq_lens),
            softmax_scale=scale, causal=True, block_table=meta.prefill_block_tables,
        )
