"""What the offline engine returns, and the sink that collects it."""
from __future__ import annotations

from dataclasses import dataclass, field

from deltas.types import FinishReason, TokenDelta


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # set when a tokenizer is loaded
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CollectingSink:
    """Offline sink: appends every delta to one RequestOutput (same thread rules
    as a collector: put may come from the output thread)."""

    __slots__ = ("output", "deltas", "keep_deltas")

    def __init__(self, output: RequestOutput, keep_deltas: bool = False):
        self.output = output
        self.keep_deltas = keep_deltas
        self.deltas: list[TokenDelta] = []

    def put(self, delta: TokenDelta, notify: bool = True, wakes=None) -> None:
        out = self.output
        out.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            out.finish_reason, out.stop_reason, out.error = delta.finish_reason, delta.stop_reason, delta.error
        if self.keep_deltas:
            self.deltas.append(delta)

    def notify(self) -> None:
        pass
