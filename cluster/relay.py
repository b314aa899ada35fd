"""The way back of one request: replica chunks -> collector -> text deltas.

A pump task reads the replica's handle stream into a `DeltaCollector`; the
consumer (the SSE writer or the non-streaming handler) takes everything pending
at once, so when it falls behind, pending deltas merge into one event instead of
queueing one event per chunk. `TextStream` detokenizes incrementally and matches
stop strings (holding text back).

The stream is stopped on the replica whenever the consumer is done before the
engine is: a stop string matched, the client disconnected (the consumer is
cancelled), or anything failed. Two signals, both idempotent: cancelling the
handle stream (Serve cancels the replica's generator, whose `finally` aborts the
engine request: this reaches exactly the replica that runs it), and an explicit
`abort` call through the handle.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from cluster.errors import (ApiError, ReplicaOverloaded, ReplicaRejected,
                            ReplicaUnavailable, bad_request, replica_cause)
from cluster.wire import decode_delta
from deltas.collector import DeltaCollector
from deltas.types import FinishReason, TextDelta, TokenDelta

logger = logging.getLogger("ray.serve")


async def open_replica_stream(stream_handle, request: dict) -> tuple[Any, TokenDelta]:
    """Start generation on a replica and wait for its first chunk, so that errors
    the engine raises before any token (overload, bad input) become HTTP errors
    before any header is sent."""
    gen = stream_handle.generate.remote(request)
    try:
        first = decode_delta(request["request_id"], await gen.__anext__())
    except BaseException as e:
        gen.cancel()
        if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        raise replica_error(e) from None
    if first.finish_reason == FinishReason.ERROR:  # no header went out yet: a real status
        gen.cancel()
        raise ApiError(500, f"The request failed: {first.error}", code="engine_error")
    return gen, first


def replica_error(exc: BaseException) -> ApiError:
    """The HTTP error for a failed replica call."""
    cause = replica_cause(exc)
    if isinstance(cause, ReplicaOverloaded):
        return ApiError(429, f"The server is overloaded: {cause.message}",
                        code="rate_limit_exceeded", retry_after_s=cause.retry_after_s)
    if isinstance(cause, ReplicaRejected):
        return bad_request(cause.message)
    if isinstance(cause, ReplicaUnavailable):
        logger.warning("engine unavailable: %s", cause.message)
        return ApiError(503, "The engine is unavailable (it failed or stalled); retry later",
                        code="engine_unavailable", retry_after_s=1.0)
    if isinstance(cause, ApiError):
        return cause
    name = type(cause).__name__
    if name == "BackPressureError":  # Serve's own queue limit on the handle
        return ApiError(503, "The server is overloaded: too many queued requests",
                        code="overloaded", retry_after_s=1.0)
    if isinstance(cause, StopAsyncIteration):
        return ApiError(500, "The engine ended the stream without output", code="engine_error")
    logger.warning("replica call failed: %s: %s", name, cause)
    return ApiError(503, f"The engine is unavailable ({name})", code="engine_unavailable")


class Relay:
    def __init__(self, request_id: str, gen, first: TokenDelta, text_stream,
                 abort: Callable[[str], None], timeout_s: float | None = None) -> None:
        self.request_id = request_id
        self._gen = gen
        self._first = first
        self._text_stream = text_stream
        self._abort = abort
        self._timeout_s = timeout_s
        self.timed_out = False  # the request ran past `timeout_s` and was stopped

    async def text_deltas(self) -> AsyncIterator[TextDelta]:
        """Text deltas until one carries a finish reason (STOP, LENGTH, ABORT or
        ERROR with `.error`). Close it (`contextlib.aclosing`) when done early."""
        collector = DeltaCollector(self.request_id)
        collector.put(self._first)
        pump = timer = None
        if self._first.finish_reason is None:
            pump = asyncio.create_task(self._pump(collector))
            if self._timeout_s is not None:
                # NOTE: one timer per request, nothing per chunk.
                timer = asyncio.get_running_loop().call_later(
                    self._timeout_s, self._time_out, collector, pump)
        engine_done = False
        try:
            while True:
                delta = await collector.get()
                engine_done = delta.finish_reason is not None
                text_delta = self._text_stream.push(delta)
                yield text_delta
                if text_delta.finish_reason is not None:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if pump is not None:
                pump.cancel()
            # Stop string, disconnect, failure or timeout: stop the replica.
            if not engine_done or self.timed_out:
                self._gen.cancel()
                self._abort(self.request_id)

    def _time_out(self, collector: DeltaCollector, pump: asyncio.Task) -> None:
        self.timed_out = True
        pump.cancel()
        collector.put_error(f"the request timed out after {self._timeout_s:g} s")

    async def _pump(self, collector: DeltaCollector) -> None:
        try:
            async for item in self._gen:
                delta = decode_delta(self.request_id, item)
                collector.put(delta)
                if delta.finish_reason is not None:
                    return
            collector.put_error("the engine ended the stream without a finish reason")
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # replica died, cancelled, or the engine failed
            err = replica_error(e)
            collector.put_error(err.message)


def is_error(text_delta: TextDelta) -> bool:
    return text_delta.finish_reason == FinishReason.ERROR


aclosing = contextlib.aclosing
