"""The attention-backend seam.

KV layout (shared by every backend, flash-attn's paged layout): per layer,
`k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

The flattened batch is laid out prefills first, then decodes (one token each).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    # (T,) int64: the cache slot each token's K/V is written to; -1 writes nothing.
    slot_mapping: torch.Tensor
    # Prefill part: tokens [0, num_prefill_tokens) of the flattened batch.
    num_prefills: int
    num_prefill_tokens: int
    prefill_query_start_loc: list[int]  # (num_prefills + 1,) cumulative query lengths
    prefill_seq_lens: list[int]  # context length per prefill seq: cached + new tokens
    prefill_block_tables: torch.Tensor | None  # (num_prefills, max_blocks) int32
    # Decode part: tokens [num_prefill_tokens, T), one per sequence.
    num_decodes: int
    decode_seq_lens: torch.Tensor | None  # (num_decodes,) int32, the current token included
    decode_block_tables: torch.Tensor | None  # (num_decodes, max_blocks) int32
    max_decode_seq_len: int = 0
    # Scratch that lives for one multi-step window (None outside windows): a
    # backend may keep per-layer state here, e.g. the gathered context.
    decode_window_cache: dict | None = None


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it."""

    name = "base"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: (T, num_kv_heads, head_dim) -> the slots in slot_mapping."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (T, num_heads, head_dim) -> (T, num_heads, head_dim).

        Called after store_kv for the same step, so every token's own K/V is in
        the cache; causal within each prefill sequence.
        """
        raise NotImplementedError
