"""One forward's inputs, sent from rank 0 to the other ranks before each forward.

Rank 0 alone schedules and samples; every forward it runs (each step of a
multi-step window, whose ids are the tokens rank 0 just sampled) goes first to the
other ranks as a plan: the token ids, positions, the rows to sample, and the
attention metadata (slots, block tables, lengths). So no rank can drift from rank 0:
each runs exactly the forward rank 0 runs, on its own shard and KV cache.
"""
from __future__ import annotations

import dataclasses

import torch

from replicas.attention.base import AttentionMetadata

SHUTDOWN = "shutdown"


def make_plan(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logits_indices: torch.Tensor | None, same_window: bool) -> dict:
    """The plan of one forward (CPU tensors). `same_window`: the forward continues
    the multi-step window of the last plan (its scratch is kept)."""
    return {"input_ids": input_ids, "positions": positions,
            "meta": dataclasses.replace(meta, decode_window_cache=None),
            "windowed": meta.decode_window_cache is not None,
            "same_window": same_window, "logits_indices": logits_indices}


class PlanReader:
    """A rank's side: a plan -> the forward's arguments, with the window's scratch
    kept across the steps of one window, as rank 0's is."""

    def __init__(self) -> None:
        self._window_cache: dict | None = None

    def forward_args(self, plan: dict) -> tuple:
        meta = plan["meta"]
        if plan["windowed"]:
            if not plan["same_window"] or self._window_cache is None:
                self._window_cache = {}
            meta = dataclasses.replace(meta, decode_window_cache=self._window_cache)
        else:
            self._window_cache = None
        return plan["input_ids"], plan["positions"], meta, plan["logits_indices"]
