"""The one interface the engine writes a request's deltas to.

Implemented by `deltas.collector.MailboxSink`, a request's way into a mailbox
read on an event loop: its own (`DeltaCollector`, an asyncio consumer in the same
process) or its ingress's (`cluster.transport.outbox.StepOutbox`, the per-step channel);
and by `replicas.offline_outputs.CollectingSink` (the offline engine). The engine's output
thread calls `put` once per step per request; `put_error` ends a stream when the
engine breaks.

NOTE: `put` takes ownership of the delta: a sink may merge later deltas into it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from deltas.types import TokenDelta

if TYPE_CHECKING:
    from deltas.collector import WakeBatch


class DeltaSink(Protocol):
    def put(self, delta: TokenDelta, notify: bool = True, wakes: WakeBatch | None = None) -> None:
        """`notify=False`: hold the wake-up until `notify()` (the end of a release
        window); `wakes`: defer it to the caller's per-step batch."""

    def notify(self) -> None: ...

    def put_error(self, message: str) -> None:
        """End the stream with an error delta (after what is already pending)."""
