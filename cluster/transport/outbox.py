"""The replica side of the per-step channel: one outbox per ingress.

The engine's output processor puts each request's delta of a step into the
request's `OutboxSink`; all sinks of one ingress feed one `StepOutbox`, a
`deltas.collector.DeltaMailbox` whose reader is that ingress's channel: per
request, everything not yet sent (merged while the channel is behind, never
dropped). The step ends with one `WakeBatch.flush`, which wakes each outbox's
channel task once: the replica's event loop wakes once per step and ingress, not
once per request.

An outbox outlives its channel calls: a request is admitted before the ingress
opens (or reopens) its channel, and its deltas wait here meanwhile. The
`OutboxRegistry` ends requests whose ingress is gone (see `sweep`).
"""
from __future__ import annotations

import asyncio
import time

from deltas.collector import DeltaMailbox, MailboxSink
from deltas.types import TokenDelta

# One request's way into its ingress's outbox: the engine's DeltaSink.
OutboxSink = MailboxSink


class StepOutbox(DeltaMailbox):
    """Created on the replica's event loop; sinks may put from any thread.

    `done[request_id]` resolves once the request's finished delta was taken for
    sending (True), or once the request was discarded (False: it never reached the
    engine, or its ingress left): its admission call then ends (Serve counts it
    ongoing until then).
    """

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner
        self.done: dict[str, asyncio.Future] = {}  # live requests (event loop side)
        self.channel_epoch = 0  # bumped when a channel attaches: older ones end
        self.is_closed = False  # the ingress is gone: channels end
        self.detached_since: float | None = time.monotonic()

    def add(self, request_id: str) -> asyncio.Future:
        if self.detached_since is not None:
            # NOTE: a new request gives its ingress a full window to (re)open the
            # channel, however long the outbox sat idle before.
            self.detached_since = time.monotonic()
        done = self.done[request_id] = self._loop.create_future()
        return done

    def discard(self, request_id: str) -> None:
        """Forget a request that never reached the engine, or whose ingress left."""
        self.drop(request_id)
        done = self.done.pop(request_id, None)
        if done is not None and not done.done():
            done.set_result(False)

    @property
    def num_live_requests(self) -> int:
        return len(self.done)

    def take_deltas(self) -> list[TokenDelta]:
        """Everything pending, one delta per request: the next step message.
        Resolves `done` of the requests whose finished delta it carries."""
        deltas = list(self.take_all().values())
        for delta in deltas:
            if delta.finish_reason is not None:
                done = self.done.pop(delta.request_id, None)
                if done is not None and not done.done():
                    done.set_result(True)
        return deltas


class OutboxRegistry:
    """The outboxes of one replica, by ingress channel id (event loop side only)."""

    def __init__(self, detach_timeout_s: float) -> None:
        self.detach_timeout_s = detach_timeout_s
        self._outboxes: dict[str, StepOutbox] = {}
        self.owner_handles: dict[str, object] = {}  # Ray actor handles, for liveness

    def get(self, owner: str) -> StepOutbox:
        outbox = self._outboxes.get(owner)
        if outbox is None or outbox.is_closed:
            outbox = self._outboxes[owner] = StepOutbox(owner)
        return outbox

    def __iter__(self):
        return iter(list(self._outboxes.values()))

    def __len__(self) -> int:
        return len(self._outboxes)

    def close(self, outbox: StepOutbox) -> list[str]:
        """The ingress is gone: end its channel, forget its requests (returned, for
        the caller to abort in the engine)."""
        outbox.is_closed = True
        outbox.interrupt()
        request_ids = list(outbox.done)
        for request_id in request_ids:
            outbox.discard(request_id)
        if self._outboxes.get(outbox.owner) is outbox:
            del self._outboxes[outbox.owner]
        self.owner_handles.pop(outbox.owner, None)
        return request_ids

    def stale(self, now: float) -> list[StepOutbox]:
        """Outboxes whose ingress left no channel attached for `detach_timeout_s`
        while requests are live, and idle detached ones (to drop)."""
        out = []
        for outbox in self._outboxes.values():
            since = outbox.detached_since
            if since is not None and now - since > self.detach_timeout_s:
                out.append(outbox)
        return out
