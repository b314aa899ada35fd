"""Rank 0's model: its shard, run after each forward's plan went to the other ranks.

The scheduler, sampling, grammars and output processing stay with rank 0 (the
engine as it is); only the model call changes. Each forward (every step of a
multi-step window) is planned once (`step_plan.py`), so the other ranks run exactly
rank 0's forwards, with the tokens it sampled.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from replicas.tensor_parallel import rank_group
from replicas.tensor_parallel.rank_processes import start_ranks
from replicas.tensor_parallel.shard import RankLayout, parallel_layers_
from replicas.tensor_parallel.step_plan import SHUTDOWN, make_plan

logger = logging.getLogger("stepstream")
STOP_TIMEOUT_S = 10.0


class RankZeroModel:
    """Stands where the model stood in ModelRunner; the rest of the model's
    attributes are its shard's."""

    def __init__(self, model: nn.Module, layout: RankLayout, vocab_size: int, config,
                 model_dir: str, max_model_len: int) -> None:
        """`model`: rank 0's shard, loaded as such."""
        world = config.tensor_parallel_size
        self.layout = layout
        address = rank_group.rendezvous_address()
        self._ranks = start_ranks(world, address, config, model_dir, max_model_len)
        try:
            rank_group.join(address, 0, world, torch.device(config.device))
        except BaseException:
            self._ranks.stop(STOP_TIMEOUT_S)
            raise
        self.model = parallel_layers_(model, layout, vocab_size)
        self._last_meta = None
        self._stopped = False

    def __getattr__(self, name):
        if name == "model":  # not set yet: never look it up in itself
            raise AttributeError(name)
        return getattr(self.model, name)

    def start_caches(self, num_blocks: int) -> None:
        """Every rank's KV cache gets rank 0's number of blocks."""
        rank_group.send(num_blocks)

    def __call__(self, input_ids, positions, kv_caches, meta, backend, logits_indices,
                 logits_out=None):
        same_window = meta is self._last_meta
        self._last_meta = meta
        rank_group.send(make_plan(input_ids, positions, meta, logits_indices, same_window))
        return self.model(input_ids, positions, kv_caches, meta, backend, logits_indices,
                          logits_out)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            rank_group.send(SHUTDOWN)
        except Exception:  # a rank already gone: nothing to tell
            logger.warning("tensor-parallel ranks were gone at shutdown", exc_info=True)
        self._ranks.stop(STOP_TIMEOUT_S)
        rank_group.leave()
