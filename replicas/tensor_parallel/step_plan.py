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


class _Packed:
    """A tensor as its dtype, shape and bytes: pickled in microseconds, where pickling
    the tensor itself goes through torch's storage reducer (about 40 us each)."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        self.dtype, self.shape = tensor.dtype, tuple(tensor.shape)
        self.data = tensor.numpy().tobytes()

    def __getstate__(self):
        return (str(self.dtype).removeprefix("torch."), self.shape, self.data)

    def __setstate__(self, state) -> None:
        dtype, self.shape, self.data = state
        self.dtype = getattr(torch, dtype)

    def tensor(self, device: torch.device) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.data), dtype=self.dtype) if self.data else \
            torch.empty(0, dtype=self.dtype)
        return flat.reshape(self.shape).to(device)


def _pack(value):
    return _Packed(value) if isinstance(value, torch.Tensor) else value


def _unpack(value, device: torch.device):
    return value.tensor(device) if isinstance(value, _Packed) else value


def make_plan(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logits_indices: torch.Tensor | None, same_window: bool) -> dict:
    """The plan of one forward. `same_window`: the forward continues the multi-step
    window of the last plan (its scratch is kept)."""
    fields = {f.name: _pack(getattr(meta, f.name)) for f in dataclasses.fields(meta)
              if f.name != "decode_window_cache"}
    return {"input_ids": _pack(input_ids), "positions": _pack(positions), "meta": fields,
            "windowed": meta.decode_window_cache is not None,
            "same_window": same_window, "logits_indices": _pack(logits_indices)}


class PlanReader:
    """A rank's side: a plan -> the forward's arguments, with the window's scratch
    kept across the steps of one window, as rank 0's is."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self._device = device
        self._window_cache: dict | None = None

    def forward_args(self, plan: dict) -> tuple:
        cache = None
        if plan["windowed"]:
            if not plan["same_window"] or self._window_cache is None:
                self._window_cache = {}
            cache = self._window_cache
        else:
            self._window_cache = None
        meta = AttentionMetadata(**{k: _unpack(v, self._device) for k, v in plan["meta"].items()},
                                 decode_window_cache=cache)
        return (_unpack(plan["input_ids"], self._device), _unpack(plan["positions"], self._device),
                meta, _unpack(plan["logits_indices"], self._device))
