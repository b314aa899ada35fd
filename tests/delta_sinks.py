"""A DeltaSink (deltas/sink.py) for tests: no event loop, every delta merged into one."""
from __future__ import annotations

from deltas.collector import WakeBatch
from deltas.types import FinishReason, TokenDelta


class ListSink:
    __slots__ = ("request_id", "delta")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.delta = TokenDelta(request_id, [])

    @property
    def finished(self) -> bool:
        return self.delta.finish_reason is not None

    def put(self, delta: TokenDelta, notify: bool = True, wakes: WakeBatch | None = None) -> None:
        if not self.finished:
            self.delta.merge(delta)

    def notify(self) -> None:
        pass

    def put_error(self, message: str) -> None:
        self.put(TokenDelta(self.request_id, [], finish_reason=FinishReason.ERROR, error=message,
                            num_output_tokens=self.delta.num_output_tokens))
