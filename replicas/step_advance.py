"""On-device advance of decode inputs between the steps of a multi-step window.

Step k's sampled ids feed step k+1 without a host round trip: next token =
sampled token, position + 1, sequence length + 1, slot from the block table.
Block tables are fixed inside a window (the scheduler reserved the lookahead).
"""
from __future__ import annotations

import torch


def slots_from_block_table(block_tables: torch.Tensor, positions: torch.Tensor,
                           block_size: int) -> torch.Tensor:
    """(B, nb) int32 tables, (B,) positions -> (B,) int64 cache slots."""
    block_idx = torch.div(positions, block_size, rounding_mode="floor").unsqueeze(1)
    blocks = block_tables.gather(1, block_idx.to(block_tables.dtype).long()).squeeze(1).long()
    return blocks * block_size + positions % block_size


def advance_decode_inputs_(input_ids: torch.Tensor, positions: torch.Tensor,
                           seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                           sampled_ids: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int) -> None:
    """In place, on the device, no sync: the inputs of the window's next step."""
    input_ids.copy_(sampled_ids)
    positions.add_(1)
    seq_lens.add_(1)
    slot_mapping.copy_(slots_from_block_table(block_tables, positions, block_size))
