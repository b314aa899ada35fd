"""One request's engine-side state.

Ownership across threads (async output processing):
- the engine thread owns `num_computed_tokens`, `block_ids`, `status` and appends
  each sampled id to `output_token_ids` right after the step's host sync;
- the output processor owns `finish_reason` / `num_final_output_tokens`: it decides
  where a request stops, which may lie a few tokens behind what the engine thread
  has already sampled (extra tokens in a multi-step window, or one async step);
  the engine thread cuts them off when it frees the request.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from deltas.sink import DeltaSink
from deltas.types import FinishReason
from replicas.config import SamplingParams


class RequestStatus(enum.IntEnum):
    # NOTE: ordered so that `status >= FINISHED` is the finished test.
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: DeltaSink
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the params' stop ids
    max_output_tokens: int  # min(max_tokens, room left in the model's context)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_ids: list[int] = field(default_factory=list)
    # Prefix cache: chained hashes of the full blocks of prompt + output hashed so
    # far, and how many leading blocks of block_ids are in the cache (hit or entered).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    # Set by the output processor (possibly from another thread).
    finish_reason: FinishReason | None = None
    num_final_output_tokens: int | None = None
    generator: Any = None  # torch.Generator for seeded sampling, made by the sampler
    grammar: Any = None  # GrammarMatcher of a structured output (replicas/sampling/structured_output.py)
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks K/V: one token per step from here."""
        return bool(self.output_token_ids) and self.num_uncomputed_tokens == 1

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output (prefill after preemption spans both)."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]
