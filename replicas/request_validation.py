"""Turns a prompt and its SamplingParams into an engine Request, or refuses it.

Both front ends (the offline Engine and the AsyncEngine) build requests here, so
they reject bad input the same way and a bad request never reaches the scheduler.
SamplingParams checked themselves already; what is checked here needs the model:
the vocabulary, the context length and the end-of-sequence ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Container

from deltas.sink import DeltaSink
from replicas.config import SamplingParams
from replicas.request import Request


@dataclass(slots=True, frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     sink: DeltaSink, ids_in_use: Container[str]) -> Request:
        """Validate and build a request; raises ValueError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_prompt(prompt_token_ids)
        V = self.vocab_size
        if any(t >= V for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {V})")
        if request_id in ids_in_use:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        room = self.max_model_len - len(prompt_token_ids)
        max_out = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(request_id, list(prompt_token_ids), params, sink, frozenset(stop_ids), max_out)

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise ValueError("prompt must be a non-empty list of token ids")
        V = self.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                raise ValueError(f"prompt token ids must be integers in [0, {V}), got {t!r}")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; this model's context is {self.max_model_len} "
                             f"tokens, so prompts may have at most {self.max_model_len - 1}")
