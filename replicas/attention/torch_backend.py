"""Attention in plain torch over the paged cache: runs on CPU (and any device),
and is the reference the other backends are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from replicas.attention.base import AttentionBackend, AttentionMetadata


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, kvh, d) x (B, nb) -> (B, kvh, nb * bs, d)."""
    B, nb = block_tables.shape
    ctx = cache.index_select(0, block_tables.reshape(-1))  # (B * nb, bs, kvh, d)
    return ctx.view(B, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        # NOTE: slot -1 (a padded row) writes nothing; the CPU path never pads, so
        # only pay for the mask when asked to.
        if slot_mapping.numel() and bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        num_prefill_tokens = meta.num_prefill_tokens
        for i in range(meta.num_prefills):
            start, end = meta.prefill_query_start_loc[i], meta.prefill_query_start_loc[i + 1]
            out[start:end] = self._prefill_one(q[start:end], k_cache, v_cache,
                                               meta.prefill_block_tables[i], meta.prefill_seq_lens[i], scale)
        if meta.num_decodes:
            self._decode_into(out[num_prefill_tokens:], q[num_prefill_tokens:], k_cache, v_cache,
                              meta, scale)
        return out

    def _decode_into(self, out, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> None:
        """out = the decode rows' attention (one query token per sequence); the CPU
        backend overrides this part only."""
        out.copy_(self._decode(q, k_cache, v_cache, meta, scale))

    @staticmethod
    def _prefill_one(q, k_cache, v_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
        """q: (n, h, d), the last n of seq_len tokens; causal with the cached prefix."""
        n = q.shape[0]
        bs = k_cache.shape[1]
        nb = -(-seq_len // bs)
        table = block_table[:nb].unsqueeze(0)
        k = gather_context(k_cache, table)[:, :, :seq_len]  # (1, kvh, L, d)
        v = gather_context(v_cache, table)[:, :, :seq_len]
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, h, n, d)
        if n == seq_len:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # (n, L)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (B, h, d), one token per sequence, attending to its whole context."""
        k, v = TorchAttentionBackend._decode_context(k_cache, v_cache, meta)  # (B, kvh, L, d)
        L = k.shape[2]
        mask = torch.arange(L, device=q.device).unsqueeze(0) < meta.decode_seq_lens.unsqueeze(1)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    @staticmethod
    def _decode_context(k_cache, v_cache, meta: AttentionMetadata):
        """The decode batch's contexts as dense (B, kvh, L, d) tensors.

        NOTE: inside a multi-step window the contexts only grow by one token per
        step and block tables are fixed, so the paged gather happens once per
        window; later steps write just the new token into the dense copy.
        """
        window = meta.decode_window_cache
        entry = window.get(k_cache.data_ptr()) if window is not None else None
        if entry is None:
            bs = k_cache.shape[1]
            tables = meta.decode_block_tables[:, :-(-meta.max_decode_seq_len // bs)]
            k = gather_context(k_cache, tables).contiguous()
            v = gather_context(v_cache, tables).contiguous()
            if window is not None:
                window[k_cache.data_ptr()] = (k, v)
            return k, v
        k, v = entry
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        slots = meta.slot_mapping[meta.num_prefill_tokens:]
        rows = torch.arange(k.shape[0], device=k.device)
        pos = (meta.decode_seq_lens - 1).long()
        k[rows, :, pos] = k_cache.view(-1, kvh, d).index_select(0, slots)
        v[rows, :, pos] = v_cache.view(-1, kvh, d).index_select(0, slots)
        return k, v
