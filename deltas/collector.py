"""Per-request mailboxes between the engine thread and a consumer: the asyncio
implementation of `deltas.sink.DeltaSink`.

The engine (producer) puts one TokenDelta per step; a consumer takes everything
pending at once. While the consumer is behind, deltas MERGE (never dropped, never
reordered), so a slow stream gets fewer, larger chunks instead of a backlog.

NOTE: `put` takes ownership of the delta: the collector may merge later deltas
into it. The engine must not touch a delta after putting it.
"""
from __future__ import annotations

import asyncio
import threading

from deltas.types import FinishReason, TokenDelta


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():  # the consumer may have been cancelled meanwhile
        waiter.set_result(None)


def _wake_all(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        _wake(waiter)


class WakeBatch:
    """Gathers the consumers to wake during one engine step, then wakes them with
    one `call_soon_threadsafe` per event loop instead of one per request.

    NOTE: with per-step release every stream is woken every step; a batch turns
    B self-pipe writes and B loop wake-ups into one.
    """

    __slots__ = ("_by_loop",)

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future) -> None:
        waiters = self._by_loop.get(loop)
        if waiters is None:
            self._by_loop[loop] = [waiter]
        else:
            waiters.append(waiter)

    def flush(self) -> None:
        if not self._by_loop:
            return
        for loop, waiters in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake_all, waiters)
            except RuntimeError:  # the loop closed: nobody is waiting any more
                pass
        self._by_loop = {}


class DeltaCollector:
    """Created in the asyncio thread; `put`/`notify` may be called from any thread.

    The cross-thread wake (`loop.call_soon_threadsafe`, a syscall) happens only
    when the consumer is actually waiting, once per wait, not once per put.
    """

    __slots__ = ("request_id", "_loop", "_loop_thread_id", "_lock", "_pending", "_waiter",
                 "_is_closed", "_is_done", "_num_output_tokens")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._pending: TokenDelta | None = None
        self._waiter: asyncio.Future | None = None
        self._is_closed = False  # a finished delta was put: later puts are dropped
        self._is_done = False  # the consumer took the finished delta
        self._num_output_tokens = 0

    @property
    def finished(self) -> bool:
        return self._is_done

    def put(self, delta: TokenDelta, notify: bool = True, wakes: WakeBatch | None = None) -> None:
        """`wakes`: defer the wake-up to the caller's batch (one per step)."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = delta.finish_reason is not None
            self._num_output_tokens = delta.num_output_tokens
            if self._pending is None:
                self._pending = delta
            else:
                self._pending.merge(delta)
            waiter = self._take_waiter_locked() if notify else None
        if waiter is not None:
            if wakes is not None and threading.get_ident() != self._loop_thread_id:
                wakes.add(self._loop, waiter)
            else:
                self._wake(waiter)

    def notify(self) -> None:
        """Wake the consumer for deltas put with notify=False (end of a release window)."""
        with self._lock:
            waiter = self._take_waiter_locked() if self._pending is not None else None
        if waiter is not None:
            self._wake(waiter)

    def put_error(self, message: str) -> None:
        self.put(TokenDelta(self.request_id, [], finish_reason=FinishReason.ERROR, error=message,
                            num_output_tokens=self._num_output_tokens))

    async def get(self) -> TokenDelta:
        """Wait until something is pending, then take all of it as one delta."""
        while True:
            with self._lock:
                if self._pending is not None:
                    delta, self._pending = self._pending, None
                    self._is_done = delta.finish_reason is not None
                    return delta
                if self._is_done:
                    raise RuntimeError(f"request {self.request_id}: the stream already finished")
                waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None

    def __aiter__(self) -> "DeltaCollector":
        return self

    async def __anext__(self) -> TokenDelta:
        if self._is_done:
            raise StopAsyncIteration
        return await self.get()

    def _take_waiter_locked(self) -> asyncio.Future | None:
        waiter, self._waiter = self._waiter, None
        return waiter

    def _wake(self, waiter: asyncio.Future) -> None:
        if threading.get_ident() == self._loop_thread_id:
            _wake(waiter)
        else:
            self._loop.call_soon_threadsafe(_wake, waiter)

