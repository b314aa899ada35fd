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
    """The offline DeltaSink (deltas/sink.py): merges every delta into one
    (TokenDelta.merge, the same rule as the streaming collectors) and mirrors it
    onto a RequestOutput. `put` may come from the output thread."""

    __slots__ = ("output", "_merged")

    def __init__(self, output: RequestOutput):
        self.output = output
        self._merged = TokenDelta(output.request_id, output.token_ids)

    def put(self, delta: TokenDelta, notify: bool = True, wakes=None) -> None:
        merged = self._merged
        merged.merge(delta)  # extends output.token_ids in place (the same list)
        out = self.output
        out.logprobs = merged.logprobs
        out.finish_reason, out.stop_reason, out.error = merged.finish_reason, merged.stop_reason, merged.error

    def notify(self) -> None:
        pass

    def put_error(self, message: str) -> None:
        self.put(TokenDelta(self.output.request_id, [], finish_reason=FinishReason.ERROR,
                            error=message, num_output_tokens=self._merged.num_output_tokens))
