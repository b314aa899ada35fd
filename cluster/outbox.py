"""The replica side of the per-step channel: one outbox per ingress.

The engine's output processor puts each request's delta of a step into the
request's `OutboxSink`; all sinks of one ingress feed one `StepOutbox`, which
keeps, per request, everything not yet sent (merged while the channel is behind,
never dropped). The step ends with one `WakeBatch.flush`, which wakes each
outbox's channel task once: the replica's event loop wakes once per step and
ingress, not once per request.

An outbox outlives its channel calls: a request is admitted before the ingress
opens (or reopens) its channel, and its deltas wait here meanwhile. The
`OutboxRegistry` ends requests whose ingress is gone (see `sweep`).
"""
from __future__ import annotations

import asyncio
import threading
import time

from cluster.wire import encode_delta
from deltas.collector import WakeBatch
from deltas.types import FinishReason, TokenDelta


class OutboxSink:
    """One request's view of its ingress's outbox: the engine's DeltaSink."""

    __slots__ = ("request_id", "_outbox", "_is_closed", "_num_output_tokens")

    def __init__(self, outbox: "StepOutbox", request_id: str) -> None:
        self.request_id = request_id
        self._outbox = outbox
        self._is_closed = False  # a finished delta was put: later puts are dropped
        self._num_output_tokens = 0

    def put(self, delta: TokenDelta, notify: bool = True, wakes: WakeBatch | None = None) -> None:
        if self._is_closed:
            return
        self._is_closed = delta.finish_reason is not None
        self._num_output_tokens = delta.num_output_tokens
        self._outbox.put(delta, notify, wakes)

    def notify(self) -> None:
        self._outbox.notify()

    def put_error(self, message: str) -> None:
        self.put(TokenDelta(self.request_id, [], finish_reason=FinishReason.ERROR, error=message,
                            num_output_tokens=self._num_output_tokens))


class StepOutbox:
    """Created on the replica's event loop; `put`/`notify` may come from any thread.

    `done[request_id]` resolves once the request's finished delta was taken for
    sending: its admission call then ends (Serve counts it ongoing until then).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: dict[str, TokenDelta] = {}
        self._waiter: asyncio.Future | None = None
        self.done: dict[str, asyncio.Future] = {}  # live requests (event loop side)
        self.channel_epoch = 0  # bumped when a channel attaches: older ones end
        self.is_closed = False  # the ingress is gone: channels end
        self.detached_since: float | None = time.monotonic()

    # -- engine side (output thread) -------------------------------------------
    def put(self, delta: TokenDelta, notify: bool, wakes: WakeBatch | None) -> None:
        with self._lock:
            pending = self._pending.get(delta.request_id)
            if pending is None:
                self._pending[delta.request_id] = delta
            else:
                pending.merge(delta)
            waiter = self._take_waiter_locked() if notify else None
        if waiter is not None:
            if wakes is not None:
                wakes.add(self._loop, waiter)
            else:
                self._loop.call_soon_threadsafe(_wake, waiter)

    def notify(self) -> None:
        with self._lock:
            waiter = self._take_waiter_locked() if self._pending else None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    # -- event loop side ----------------------------------------------------------
    def add(self, request_id: str) -> asyncio.Future:
        if self.detached_since is not None:
            # NOTE: a new request gives its ingress a full window to (re)open the
            # channel, however long the outbox sat idle before.
            self.detached_since = time.monotonic()
        done = self.done[request_id] = self._loop.create_future()
        return done

    def discard(self, request_id: str) -> None:
        """Forget a request that never reached the engine, or whose ingress left."""
        with self._lock:
            self._pending.pop(request_id, None)
        done = self.done.pop(request_id, None)
        if done is not None and not done.done():
            done.set_result(None)

    @property
    def num_live_requests(self) -> int:
        return len(self.done)

    async def wait(self) -> None:
        """Until something is pending (or a wake from `interrupt`)."""
        with self._lock:
            if self._pending:
                return
            waiter = self._waiter = self._loop.create_future()
        await waiter

    def interrupt(self) -> None:
        """Wake the channel task now (a newer channel attached, or the outbox closed)."""
        with self._lock:
            waiter = self._take_waiter_locked()
        if waiter is not None:
            _wake(waiter)

    def take_message(self) -> list:
        """Everything pending, encoded as one step message; resolves `done` of the
        requests whose finished delta it carries."""
        with self._lock:
            pending, self._pending = self._pending, {}
        message = []
        for delta in pending.values():
            message.append(encode_delta(delta))
            if delta.finish_reason is not None:
                done = self.done.pop(delta.request_id, None)
                if done is not None and not done.done():
                    done.set_result(None)
        return message

    def _take_waiter_locked(self) -> asyncio.Future | None:
        waiter, self._waiter = self._waiter, None
        return waiter


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
