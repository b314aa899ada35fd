"""Grammar work (checks, compiles) off the event loop, in two lanes by size.

llguidance checks and compiles in Rust with the GIL released, so a worker thread
keeps the event loop (every stream of an ingress or engine replica) running. What
a shared pool alone got wrong, under load:
- its time limit counted the wait in its queue, so a grammar that compiles in
  0.3 s failed behind eleven others;
- one client's large grammars queued ahead of everyone's small ones.

So a job's time limit counts from when a worker starts it, its wait for a worker
has a bound of its own (`LanesBusy` past it, and past a full queue), and grammars
above `LARGE_ABOVE_CHARS` queue in a lane of their own: large grammars (seconds
each) wait only behind each other, and a small one never waits behind them.
Jobs are keyed by grammar text: a job asked for again while it is queued or
running is joined, not run twice (the `n` choices of a request, or many clients
sending one schema).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Callable

LARGE_ABOVE_CHARS = 64 * 1024
MAX_QUEUED_PER_LANE = 32
QUEUE_TIMEOUT_S = 30.0


class LanesBusy(Exception):
    """No worker took the job in time, or its lane's queue is full: the server is
    busy (a 429 to the client), not the grammar wrong."""


class TooSlow(Exception):
    """The job ran past its time limit (it goes on in its worker: llguidance's
    own limits end it)."""


class _Job:
    __slots__ = ("started", "started_at", "result", "num_waiters")

    def __init__(self) -> None:
        self.num_waiters = 0  # callers still waiting for it to start
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self.started_at = 0.0
        self.result: concurrent.futures.Future = concurrent.futures.Future()


class CompileLanes:
    def __init__(self, name: str, workers_per_lane: int = 1,
                 large_above_chars: int = LARGE_ABOVE_CHARS,
                 max_queued_per_lane: int = MAX_QUEUED_PER_LANE,
                 queue_timeout_s: float = QUEUE_TIMEOUT_S) -> None:
        self._lanes = [concurrent.futures.ThreadPoolExecutor(workers_per_lane,
                                                             thread_name_prefix=f"{name}-{lane}")
                       for lane in ("small", "large")]
        self._num_queued = [0, 0]
        self._large_above_chars = large_above_chars
        self._max_queued = max_queued_per_lane
        self.queue_timeout_s = queue_timeout_s
        self._jobs: dict[str, _Job] = {}  # by key, while queued or running
        self._lock = threading.Lock()

    def submit(self, key: str, size: int, fn: Callable[[], object]) -> _Job:
        """The job for `key` (queued now, or the one already queued or running);
        `size` (characters) picks its lane."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                job.num_waiters += 1
                return job
            lane = int(size > self._large_above_chars)
            if self._num_queued[lane] >= self._max_queued:
                raise LanesBusy(f"{self._num_queued[lane]} grammars wait for a worker")
            job = self._jobs[key] = _Job()
            job.num_waiters = 1
            self._num_queued[lane] += 1
        self._lanes[lane].submit(self._run, key, lane, job, fn)
        return job

    def _run(self, key: str, lane: int, job: _Job, fn: Callable[[], object]) -> None:
        with self._lock:
            self._num_queued[lane] -= 1
            abandoned = job.num_waiters == 0
            if abandoned:
                del self._jobs[key]
        if abandoned:  # every waiter gave up on it before a worker was free
            return
        job.started_at = time.monotonic()
        job.started.set_result(None)
        try:
            job.result.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            job.result.set_exception(e)
        finally:
            self._forget(key, job)

    def _forget(self, key: str, job: _Job) -> None:
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]

    def _give_up(self, job: _Job) -> LanesBusy:
        with self._lock:
            job.num_waiters -= 1
        return LanesBusy(f"no worker was free within {self.queue_timeout_s:g} s")

    def run(self, key: str, size: int, fn: Callable[[], object], timeout_s: float):
        """`fn()`'s result, run in a worker; raises LanesBusy, TooSlow or what `fn` raised."""
        job = self.submit(key, size, fn)
        try:
            job.started.result(timeout=self.queue_timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._give_up(job) from None
        try:
            return job.result.result(timeout=_time_left(job, timeout_s))
        except concurrent.futures.TimeoutError:
            raise TooSlow() from None

    async def run_async(self, key: str, size: int, fn: Callable[[], object], timeout_s: float):
        """The same, awaited: the event loop runs on meanwhile."""
        job = self.submit(key, size, fn)
        started = asyncio.wrap_future(job.started)
        try:
            await asyncio.wait_for(asyncio.shield(started), self.queue_timeout_s)
        except asyncio.TimeoutError:
            raise self._give_up(job) from None
        except asyncio.CancelledError:  # its caller left
            self._give_up(job)
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.result)),
                                          _time_left(job, timeout_s))
        except asyncio.TimeoutError:
            raise TooSlow() from None


def _time_left(job: _Job, timeout_s: float) -> float:
    return max(0.0, job.started_at + timeout_s - time.monotonic())
