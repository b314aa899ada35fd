"""Plain data that crosses the engine -> replica -> ingress boundary.

`TokenDelta` is a msgspec `Struct` (array-like: its fields are packed by position,
named only in this declaration) because every per-step message a replica streams
carries one per request: it is built per token in the engine's output loop and
encoded, without conversion, into the step message (`cluster/transport/wire.py`). Nothing
here imports torch or knows about HTTP.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec


class OutputKind(enum.IntEnum):
    DELTA = 0  # only the new tokens since the last output (default for streams)
    CUMULATIVE = 1  # every output carries all tokens so far
    FINAL_ONLY = 2  # one output, at the finish


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the engine failed while the request ran

    def __str__(self) -> str:  # JSON-friendly: "stop", not "FinishReason.STOP"
        return self.value


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request. Merging two deltas concatenates them.

    NOTE: `num_output_tokens` counts all tokens generated so far (not only the
    ones in this delta), so a consumer can report usage without keeping state.
    NOTE: the field order is the wire order. `gc=False`: a delta holds ids,
    numbers and strings, never a cycle, so the garbage collector need not track
    the one built per token.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each token in token_ids
    # per token: the top-k alternatives as (token_id, logprob) pairs
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set with FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "TokenDelta") -> None:
        """Append `later` (the next delta of the same request) in place."""
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(later.top_logprobs)
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.stop_reason = later.stop_reason
            self.error = later.error
        self.num_output_tokens = later.num_output_tokens
        if later.num_prompt_tokens:
            self.num_prompt_tokens = later.num_prompt_tokens


@dataclass(slots=True)
class TextDelta:
    """What the ingress turns into one SSE event: new text plus its tokens."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
