"""AsyncEngine: the engine loop on its own thread, streams on the asyncio loop.

    async for delta in engine.generate(request_id, prompt_token_ids, params): ...

The loop thread owns the EngineCore; the asyncio side only appends commands
(add, abort) to a queue and reads per-request collectors, which merge deltas
while a consumer is behind. Cancelling or closing a stream turns into an
explicit engine abort: asyncio cancellation never reaches the thread by itself.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from deltas.collector import DeltaCollector
from deltas.sink import DeltaSink
from deltas.types import FinishReason, OutputKind, TokenDelta
from replicas.config import EngineConfig, SamplingParams
from replicas.engine_core import EngineCore
from replicas.engine_stats import EngineStats
from replicas.os_thread_name import ENGINE_STEP_THREAD, name_this_thread
from replicas.request import Request
from replicas.sampling.structured_output import GrammarMatcher

logger = logging.getLogger("stepstream")


class EngineOverloaded(Exception):
    """The waiting queue is full; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine thread died or stopped making progress."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, stall_timeout_s: float = 60.0):
        self.config = config
        self.core = EngineCore(config)
        self.stall_timeout_s = stall_timeout_s
        self._commands: deque[tuple[str, object]] = deque()
        # Adds queued for the engine thread and not withdrawn by an abort: the
        # admission bounds count them as waiting (the published snapshot cannot see
        # them yet); queued aborts count as nothing. NOTE: the engine thread moves an
        # add into the scheduler and republishes the snapshot under the lock, so a
        # reader never counts a request twice or not at all.
        self._queue_lock = threading.Lock()
        self._queued_adds: dict[str, Request] = {}
        self._num_queued_prompt_tokens = 0
        self._wakeup = threading.Event()
        self._is_stopping = False
        self._error: str | None = None
        self._last_progress = time.monotonic()
        self._active: dict[str, DeltaSink] = {}  # asyncio side only
        self.fault_hook: Callable[[], None] | None = None  # tests inject faults here
        self._thread = threading.Thread(target=self._run, name="stepstream-engine", daemon=True)
        self._thread.start()

    # -- model facts ------------------------------------------------------------
    @property
    def model_dir(self) -> str:
        return self.core.model_dir

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.core.eos_token_ids)

    # -- requests -------------------------------------------------------------
    async def compile_grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        """The structured output of `params` compiled without blocking the event loop
        (None without one), for `submit`; raises InvalidValue naming the problem."""
        if params.structured_output is None:
            return None
        return await self.core.grammars.compile_async(params.structured_output)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: DeltaSink, grammar: GrammarMatcher | None = None) -> None:
        """Queue a request whose deltas go to `sink` (one `put` per step, merged by
        the sink while its reader is behind). Raises before queueing: ValueError
        for bad input, EngineOverloaded past the queue bounds, EngineDeadError.
        The caller calls `release(request_id)` once it is done with the request
        (after the finished delta, or after `abort`)."""
        self._raise_if_dead()
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_overload(len(prompt_token_ids) if isinstance(prompt_token_ids, list) else 0)
        req = self.core.make_request(request_id, prompt_token_ids, params, sink, grammar)
        self._active[request_id] = sink
        with self._queue_lock:
            self._queued_adds[request_id] = req
            self._num_queued_prompt_tokens += req.num_prompt_tokens
        self._send("add", req)

    def release(self, request_id: str) -> None:
        """Forget a request's sink (asyncio side); an unfinished request is aborted."""
        if self._active.pop(request_id, None) is not None:
            self.abort(request_id)  # NOTE: idempotent: a finished request ignores it

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Stream one request's deltas (DELTA, CUMULATIVE or FINAL_ONLY, as its
        params say). Closing or cancelling the stream aborts the request."""
        grammar = await self.compile_grammar(params)
        collector = DeltaCollector(request_id)
        self.submit(request_id, prompt_token_ids, params, collector, grammar)
        kind = params.output_kind
        is_finished = False
        all_ids: list[int] = []
        try:
            while True:
                delta = await collector.get()
                is_finished = delta.finished
                if kind == OutputKind.DELTA:
                    yield delta
                elif kind == OutputKind.CUMULATIVE:
                    all_ids.extend(delta.token_ids)
                    delta.token_ids = list(all_ids)
                    yield delta
                else:  # FINAL_ONLY
                    all_ids.extend(delta.token_ids)
                    if is_finished:
                        delta.token_ids = all_ids
                        yield delta
                if is_finished:
                    return
        finally:
            if is_finished:
                self._active.pop(request_id, None)
            else:
                self.release(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; the request ends within one engine step."""
        with self._queue_lock:
            is_withdrawn = self._unqueue(request_id)
        if not is_withdrawn:  # a withdrawn add ends when the engine thread meets it
            self._send("abort", request_id)

    def _unqueue(self, request_id: str, req: Request | None = None) -> bool:
        """Lock held: stop counting the queued add of `request_id` (only if it is
        `req`, when given); False if there is none."""
        queued = self._queued_adds.get(request_id)
        if queued is None or (req is not None and queued is not req):
            return False
        del self._queued_adds[request_id]
        self._num_queued_prompt_tokens -= queued.num_prompt_tokens
        return True

    def _send(self, command: str, arg: object) -> None:
        self._commands.append((command, arg))
        self._wakeup.set()

    def _check_overload(self, num_prompt_tokens: int) -> None:
        cfg = self.config
        # NOTE: the engine thread's published snapshot, not its live queues (see
        # replicas/engine_stats.py); queued adds are counted on top of it.
        with self._queue_lock:
            load = self.core.published_stats
            num_waiting = load.num_waiting + len(self._queued_adds)
            num_waiting_tokens = load.num_waiting_prompt_tokens + self._num_queued_prompt_tokens
        if cfg.max_waiting_requests is not None and num_waiting >= cfg.max_waiting_requests:
            raise EngineOverloaded(f"{num_waiting} requests are waiting (limit "
                                   f"{cfg.max_waiting_requests})", self._retry_after_s())
        # NOTE: a prompt above the token bound is admitted when nothing waits (else
        # it never would be).
        if (cfg.max_waiting_prompt_tokens is not None and num_waiting_tokens
                and num_waiting_tokens + num_prompt_tokens > cfg.max_waiting_prompt_tokens):
            raise EngineOverloaded(f"{num_waiting_tokens} prompt tokens are waiting "
                                   f"(limit {cfg.max_waiting_prompt_tokens})", self._retry_after_s())

    def _retry_after_s(self) -> float:
        # NOTE: a rough drain time: one more admission round per waiting batch.
        return 1.0

    # -- the engine thread ------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            name_this_thread(ENGINE_STEP_THREAD)
            core.bind_thread()
            while not self._is_stopping:
                if not core.has_work and not self._commands:
                    self._wakeup.wait(1.0)
                    self._last_progress = time.monotonic()
                self._wakeup.clear()
                self._drain_commands()
                if core.has_work:
                    if self.fault_hook is not None:
                        self.fault_hook()
                    core.step()
                    self._last_progress = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - every failure must end the streams
            self._error = f"engine failed: {type(e).__name__}: {e}"
            logger.exception("engine loop failed")
            self._fail_everything()

    def _drain_commands(self) -> None:
        core = self.core
        while self._commands:
            command, arg = self._commands.popleft()
            if command != "add":
                core.abort_request(arg)
                continue
            with self._queue_lock:
                if self._unqueue(arg.request_id, arg):
                    core.add_request(arg)
                    continue
            # aborted while queued: it never waits in the scheduler
            arg.sink.put(TokenDelta(arg.request_id, [], finish_reason=FinishReason.ABORT,
                                    num_prompt_tokens=arg.num_prompt_tokens, num_output_tokens=0))

    def _fail_everything(self) -> None:
        try:
            self.core.fail_all(self._error)
        except Exception:  # noqa: BLE001
            logger.exception("could not fail requests cleanly")
        for collector in list(self._active.values()):
            collector.put_error(self._error)
        while self._commands:
            command, arg = self._commands.popleft()
            if command == "add":
                arg.sink.put_error(self._error)

    # -- health and stats -------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(self._error or "the engine thread is not running")

    def check_health(self) -> None:
        """Raises EngineDeadError if the loop died, or stalled with work queued."""
        self._raise_if_dead()
        stalled_s = time.monotonic() - self._last_progress
        has_work = self.core.published_stats.num_unfinished > 0
        if (has_work or self._commands) and stalled_s > self.stall_timeout_s:
            raise EngineDeadError(f"the engine made no progress for {stalled_s:.0f} s with work queued")

    def fail_stalled(self) -> None:
        """End every stream with an error (the loop is stuck and cannot do it)."""
        self._error = self._error or "engine stalled"
        for collector in list(self._active.values()):
            collector.put_error(self._error)

    def stats(self) -> EngineStats:
        return self.core.stats().with_active_streams(len(self._active))

    def shutdown(self) -> None:
        self._is_stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.core.shutdown()
