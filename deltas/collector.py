"""Mailboxes between the engine's threads and an asyncio reader: the asyncio
implementations of `deltas.sink.DeltaSink`.

One mechanism, used twice: a `DeltaMailbox` keeps, per request, everything its
reader has not taken yet. While the reader is behind, a request's deltas MERGE
(never dropped, never reordered), so a slow reader gets fewer, larger deltas
instead of a backlog; a waiting reader is woken once per wait, not once per put.

- `DeltaCollector`: one request, one reader (an `AsyncEngine` stream). Its `get`
  takes everything pending at once.
- `cluster.transport.outbox.StepOutbox`: every request of one ingress, one reader (the
  per-step channel), which takes all requests' deltas at once.

Each request writes through its own `MailboxSink`, which drops puts after the
finished delta and ends the stream with `put_error`.

`LoopCollector` keeps the same rules (merge while behind, drop after the finish,
one wake per wait) for one request whose puts come from its reader's own loop (the
ingress's channel hub), without the lock.

NOTE: `put` takes ownership of the delta: the mailbox may merge later deltas
into it. The engine must not touch a delta after putting it.
"""
from __future__ import annotations

import asyncio
import threading

from deltas.types import FinishReason, TokenDelta


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():  # the reader may have been cancelled meanwhile
        waiter.set_result(None)


def _wake_all(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        _wake(waiter)


class WakeBatch:
    """Gathers the readers to wake during one engine step, then wakes them with
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


class DeltaMailbox:
    """Pending deltas by request id, for one reader on the event loop it was
    created on; puts (through `MailboxSink`s) and `notify` may come from any thread.

    The cross-thread wake (`loop.call_soon_threadsafe`, a syscall) happens only
    when the reader is actually waiting, once per wait, not once per put.
    """

    __slots__ = ("_loop", "_loop_thread_id", "_lock", "_pending", "_waiter")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._pending: dict[str, TokenDelta] = {}
        self._waiter: asyncio.Future | None = None

    # -- writers (any thread) -------------------------------------------------------
    def _put(self, sink: MailboxSink, delta: TokenDelta, notify: bool,
             wakes: WakeBatch | None) -> None:
        with self._lock:
            if sink._is_closed:
                return
            sink._is_closed = delta.finish_reason is not None
            sink._num_output_tokens = delta.num_output_tokens
            pending = self._pending.get(sink.request_id)
            if pending is None:
                self._pending[sink.request_id] = delta
            else:
                pending.merge(delta)
            waiter = self._take_waiter_locked() if notify else None
        if waiter is not None:
            self._wake(waiter, wakes)

    def notify(self) -> None:
        """Wake the reader for deltas put with notify=False (end of a release window)."""
        with self._lock:
            waiter = self._take_waiter_locked() if self._pending else None
        if waiter is not None:
            self._wake(waiter, None)

    # -- the reader (event loop) ----------------------------------------------------
    def take(self, request_id: str) -> TokenDelta | None:
        """Everything pending for one request, as one delta (None: nothing)."""
        with self._lock:
            return self._pending.pop(request_id, None)

    def take_all(self) -> dict[str, TokenDelta]:
        """Everything pending, one delta per request."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    async def wait(self) -> None:
        """Until something is pending (or a wake from `interrupt`)."""
        with self._lock:
            if self._pending:
                return
            waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            with self._lock:
                if self._waiter is waiter:
                    self._waiter = None

    def interrupt(self) -> None:
        """Wake the reader now, whatever is pending."""
        with self._lock:
            waiter = self._take_waiter_locked()
        if waiter is not None:
            self._wake(waiter, None)

    def _take_waiter_locked(self) -> asyncio.Future | None:
        waiter, self._waiter = self._waiter, None
        return waiter

    def _wake(self, waiter: asyncio.Future, wakes: WakeBatch | None) -> None:
        if threading.get_ident() == self._loop_thread_id:
            _wake(waiter)
        elif wakes is not None:
            wakes.add(self._loop, waiter)
        else:
            try:
                self._loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the loop closed: nobody is waiting any more
                pass


class MailboxSink:
    """One request's way into a mailbox: the engine's `DeltaSink` for it."""

    __slots__ = ("request_id", "_mailbox", "_is_closed", "_num_output_tokens")

    def __init__(self, mailbox: DeltaMailbox, request_id: str) -> None:
        self.request_id = request_id
        self._mailbox = mailbox
        self._is_closed = False  # a finished delta was put: later puts are dropped
        self._num_output_tokens = 0

    def put(self, delta: TokenDelta, notify: bool = True, wakes: WakeBatch | None = None) -> None:
        """`wakes`: defer the wake-up to the caller's batch (one per step)."""
        self._mailbox._put(self, delta, notify, wakes)

    def notify(self) -> None:
        self._mailbox.notify()

    def put_error(self, message: str) -> None:
        self.put(TokenDelta(self.request_id, [], finish_reason=FinishReason.ERROR, error=message,
                            num_output_tokens=self._num_output_tokens))


class DeltaCollector(MailboxSink):
    """A mailbox of one request for one asyncio reader. Created in the asyncio
    thread; `put`/`notify`/`put_error` may be called from any thread."""

    __slots__ = ("_is_done",)

    def __init__(self, request_id: str) -> None:
        super().__init__(DeltaMailbox(), request_id)
        self._is_done = False  # the reader took the finished delta

    @property
    def finished(self) -> bool:
        return self._is_done

    async def get(self) -> TokenDelta:
        """Wait until something is pending, then take all of it as one delta."""
        while True:
            delta = self._mailbox.take(self.request_id)
            if delta is not None:
                self._is_done = delta.finish_reason is not None
                return delta
            if self._is_done:
                raise RuntimeError(f"request {self.request_id}: the stream already finished")
            await self._mailbox.wait()

    def __aiter__(self) -> DeltaCollector:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._is_done:
            raise StopAsyncIteration
        return await self.get()


class LoopCollector:
    """`DeltaCollector`'s interface for a request whose puts all come from its
    reader's own event loop: no lock, one pending delta, the waiting reader woken
    directly. The ingress's channel hub, its timers and its watchers run on the
    loop that reads (cluster/transport/channels.py).

    Why: with per-step release the ingress puts and takes one delta per stream per
    step; dropping the mailbox's lock and dict took about a sixth off its own work
    per event (10.8 -> 9.0 us; docs/performance.md, "What the HTTP path costs")."""

    __slots__ = ("request_id", "_pending", "_waiter", "_is_closed", "_is_done",
                 "_num_output_tokens")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: TokenDelta | None = None
        self._waiter: asyncio.Future | None = None
        self._is_closed = False  # a finished delta was put: later puts are dropped
        self._is_done = False  # the reader took the finished delta
        self._num_output_tokens = 0

    def put(self, delta: TokenDelta, notify: bool = True) -> None:
        if self._is_closed:
            return
        self._is_closed = delta.finish_reason is not None
        self._num_output_tokens = delta.num_output_tokens
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        if notify:
            self._wake()

    def notify(self) -> None:
        if self._pending is not None:
            self._wake()

    def put_error(self, message: str) -> None:
        self.put(TokenDelta(self.request_id, [], finish_reason=FinishReason.ERROR, error=message,
                            num_output_tokens=self._num_output_tokens))

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # the reader may have been cancelled
            waiter.set_result(None)

    @property
    def finished(self) -> bool:
        return self._is_done

    async def get(self) -> TokenDelta:
        """Wait until something is pending, then take all of it as one delta."""
        while True:
            delta = self._pending
            if delta is not None:
                self._pending = None
                self._is_done = delta.finish_reason is not None
                return delta
            if self._is_done:
                raise RuntimeError(f"request {self.request_id}: the stream already finished")
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None

    def __aiter__(self) -> LoopCollector:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._is_done:
            raise StopAsyncIteration
        return await self.get()
