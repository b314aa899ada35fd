"""What a request must meet to run on this model: its rules, declared once.

`SamplingParams` check their own values (replicas/config.py); what is checked here
needs the model: the vocabulary (stop ids, logit_bias keys), the context length and
the end-of-sequence ids.
Every refusal is an `InvalidValue` naming the field at fault.

The ingress checks an HTTP request here before admitting it (a refusal is a 400
naming the field). The engine's front ends (the offline Engine and the
AsyncEngine) build each `Request` here, through the same checks: the engine's own
defence, so a bad request never reaches the scheduler, whoever sent it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Container

from deltas.sink import DeltaSink
from replicas.config import InvalidValue, SamplingParams
from replicas.request import Request

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(slots=True, frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def check(self, prompt_token_ids: list[int], params: SamplingParams,
              must_fit: bool = False) -> int:
        """The most output tokens the request may make: `max_tokens` cut to the
        room the context leaves (None: all of that room). With `must_fit` (the
        OpenAI API's rule) a `max_tokens` past that room is refused instead.
        Raises InvalidValue naming the field."""
        if not isinstance(params, SamplingParams):
            raise InvalidValue(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_prompt(prompt_token_ids)
        V = self.vocab_size
        if any(t >= V for t in params.stop_token_ids):
            raise InvalidValue(f"stop_token_ids must be in [0, {V})", "stop_token_ids")
        if params.logit_bias and params.logit_bias[-1][0] >= V:  # NOTE: sorted by id
            raise InvalidValue(f"logit_bias keys must be token ids in [0, {V}), got "
                               f"{params.logit_bias[-1][0]}", "logit_bias")
        n = len(prompt_token_ids)
        room = self.max_model_len - n
        if params.max_tokens is None:
            return room
        if must_fit and params.max_tokens > room:
            raise InvalidValue(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or "
                "max_tokens.", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
        return min(params.max_tokens, room)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     sink: DeltaSink, ids_in_use: Container[str]) -> Request:
        """Check (`check`) and build a request; raises ValueError naming what is wrong."""
        max_out = self.check(prompt_token_ids, params)
        if request_id in ids_in_use:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        return Request(request_id, list(prompt_token_ids), params, sink, frozenset(stop_ids), max_out)

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise InvalidValue("prompt must be a non-empty list of token ids", "prompt")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:  # NOTE: first: a huge prompt is refused at once
            raise InvalidValue(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {n} tokens, which leaves no room for a completion (a prompt may "
                f"have at most {self.max_model_len - 1}). Please shorten the prompt.",
                "prompt", CONTEXT_LENGTH_EXCEEDED)
        V = self.vocab_size
        # NOTE: types, min and max in C; the loop only finds the culprit to name it.
        if set(map(type, prompt_token_ids)) != {int} or min(prompt_token_ids) < 0 \
                or max(prompt_token_ids) >= V:
            bad = next(t for t in prompt_token_ids if type(t) is not int or not 0 <= t < V)
            raise InvalidValue(f"prompt token ids must be integers in [0, {V}), got {bad!r}",
                               "prompt")
