"""One draw per row from a categorical distribution with one uniform number per row.

`inverse_cdf_draw_no_sync(weights, uniforms)` returns, for each row of non-negative
`weights` (B, V), the first index whose cumulative weight exceeds `uniform * total`:
an exact draw from `weights / total`, with O(V) arithmetic and O(1) random numbers
per row. The exponential race (argmax of p / q, q ~ Exp(1)) needs V random numbers
per row; on a CPU drawing them costs far more than the rest of sampling.

The search is two-level, so no (B, V) temporary is made: the sums of blocks of
`BLOCK` weights pick a block, then that block's cumulative sum (float64) picks the
index. Block sums are float32 (a float64 sum would first copy the whole batch to
float64, the most costly part of the draw), 128 terms each, so a block's share of
the mass is off by less than 1e-5 of itself, and accumulated across blocks in
float64. A row's draw never lands on an index of zero weight (a masked token): the
residual is kept strictly below its block's sum, and a block is picked only if its
sum is above 0.
No host sync: the result stays on the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128


def inverse_cdf_draw_no_sync(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B, V) non-negative weights, each row with a positive sum; (B,) uniforms in
    [0, 1) (float64) -> (B,) int64 indices."""
    num_rows, vocab = weights.shape
    num_blocks = -(-vocab // BLOCK)
    if vocab % BLOCK:
        # NOTE: zero weights past the end are never drawn (see the module docstring).
        weights = F.pad(weights, (0, num_blocks * BLOCK - vocab))
    blocks = weights.reshape(num_rows, num_blocks, BLOCK)
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)  # (B, nb)
    target = uniforms.to(torch.float64).unsqueeze(1) * block_cdf[:, -1:]  # (B, 1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    mass_before = block_cdf.gather(1, (block - 1).clamp_(min=0))
    mass_before = torch.where(block > 0, mass_before, torch.zeros_like(mass_before))
    block = block.squeeze(1)
    rows = torch.arange(num_rows, device=weights.device)
    inner_cdf = blocks[rows, block].cumsum(dim=-1, dtype=torch.float64)  # (B, BLOCK)
    # NOTE: strictly below the block's own sum (which may differ from its share of
    # block_cdf in the last bit), so the index found has a positive weight.
    below_sum = torch.nextafter(inner_cdf[:, -1:], torch.zeros_like(inner_cdf[:, -1:]))
    residual = torch.minimum(target - mass_before, below_sum).clamp_(min=0.0)
    inner = torch.searchsorted(inner_cdf, residual, right=True).squeeze(1)
    return block * BLOCK + inner
