"""The way back of one request: admission call + channel deltas -> text deltas.

`Relay.open` registers the request's collector with the ingress's `ChannelHub`,
admits the request through a Serve handle call (refusals become HTTP errors),
attaches it to the channel of the replica that admitted it, and waits for the
first delta, so a request that fails before its first token still gets a real
HTTP status. `text_deltas` then drains the collector (everything pending at once,
so a consumer that falls behind gets one merged delta) through `TextStream`
(incremental detokenizing, stop strings with hold-back).

A request whose replica is lost before its first token is tried again on another
replica, before any header went out, under a fresh engine request id
(`<id>~<attempt>`): whatever the lost replica still sends for the old id is
dropped, so a stream never mixes two replicas' deltas. Lost means: the admission
call is refused because the replica's engine died (up to 3 attempts; that replica
is avoided for a while, cluster/transport/replica_avoidance.py), or the replica
itself is gone: the admission call fails because its actor died or cannot be
reached, or its channel fails that way before the first delta (one retry: a request
that took its replica down must not take the next). Serve's router drops a dead
actor by itself. An engine that fails a request it already admitted (an error
delta) is its answer, never retried. A replica lost after the first delta ends the
deltas with an error and sets `replica_lost`: the ingress may still run a
non-streamed request again, as none of its answer went out, if the request has its
retry left (`num_replica_losses`; cluster/api/choice_runs.py).
Waiting for the first token (Serve's queue, the engine's queue, the prefill) is
bounded by `queue_timeout_s`: past it, 503 + Retry-After.

The admission call stays open until the request ends; a watcher turns its
failure (the replica died) into an error delta. Whenever the consumer is done
before the engine (stop string, client gone, timeout, failure), the admission
call is cancelled: Serve cancels the replica's `generate`, whose `finally`
aborts the request on exactly the replica that runs it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import msgspec

from cluster.transport.channels import ChannelHub
from cluster.errors import (ApiError, ReplicaUnavailable, is_replica_lost, replica_cause,
                            replica_error)
from cluster.transport.replica_avoidance import avoid_replica
from cluster.transport.wire import EngineRequest, encode_request
from deltas.collector import LoopCollector
from deltas.types import FinishReason, TextDelta, TokenDelta

logger = logging.getLogger("ray.serve")

# How long a request may wait for its finished delta after its admission call
# ended cleanly (the two travel on different streams) before it is failed.
_FINISH_GRACE_S = 10.0
# Admissions of one request: the first, and retries on other replicas when its
# replica turned out lost before the first token.
MAX_ADMISSION_ATTEMPTS = 3
# Of those, retries after the replica itself was lost (its actor died or cannot be
# reached, its channel failed), not refused cleanly by a dead engine: a request that
# took its replica down (out of memory in its prefill, say) takes one more at most.
# One per request: a non-streamed answer run again after a loss mid-answer uses it
# (cluster/api/choice_runs.py).
MAX_REPLICA_LOSS_RETRIES = 1
RETRY_BACKOFF_S = 0.05
# Between a request's id and its attempt number in a retry's engine request id.
RETRY_ID_SEP = "~"
QUEUE_TIMEOUT_RETRY_AFTER_S = 5.0


class Relay:
    def __init__(self, request_id: str, hub: ChannelHub, call, collector: LoopCollector,
                 text_stream, timeout_s: float | None = None,
                 deadline: float | None = None) -> None:
        self.request_id = request_id
        self._hub = hub
        self._call = call
        self._collector = collector
        self._text_stream = text_stream
        self._timeout_s = timeout_s
        self._deadline = deadline
        self._first: TokenDelta | None = None
        self._watcher: asyncio.Task | None = None
        self._base_id = request_id
        self._failure: ApiError | None = None  # why the admission call failed
        self._failure_cause: BaseException | None = None
        self.timed_out = False  # the request ran past `timeout_s` and was stopped
        # replicas lost before its first delta (each retried elsewhere), and whether
        # its replica was lost after it (actor gone, channel failed)
        self.num_replica_losses = 0
        self.replica_lost = False
        self._replica_id: str | None = None
        self._closed = False  # its admission call and collector are let go

    @classmethod
    async def open(cls, engine_stream, hub: ChannelHub, request: EngineRequest, text_stream,
                   timeout_s: float | None = None, queue_timeout_s: float | None = None,
                   max_replica_loss_retries: int = MAX_REPLICA_LOSS_RETRIES,
                   deadline: float | None = None) -> "Relay":
        """Admit `request` and wait for its first delta. Raises ApiError (400, 429,
        503, 500) when it is refused or fails before its first token, and 503 when
        that takes longer than `queue_timeout_s`. `max_replica_loss_retries`: what is
        left of the request's retries after lost replicas (a run again has none);
        `deadline` (time.monotonic()): when it times out, where not `timeout_s`
        after its first token (a run again keeps its first run's)."""
        collector = hub.register(request.request_id)
        relay = cls(request.request_id, hub, None, collector, text_stream, timeout_s, deadline)
        try:
            try:
                await asyncio.wait_for(relay._admit(engine_stream, request,
                                                    max_replica_loss_retries), queue_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(503, f"The request got no first token within "
                               f"{queue_timeout_s:g} s (queue_timeout_s): the server is busy; "
                               "retry later", code="queue_timeout",
                               retry_after_s=QUEUE_TIMEOUT_RETRY_AFTER_S) from None
        except BaseException:
            relay._close(engine_done=False)
            raise
        return relay

    async def _admit(self, engine_stream, request: EngineRequest,
                     max_replica_loss_retries: int) -> None:
        for attempt in range(MAX_ADMISSION_ATTEMPTS):
            if attempt:
                await asyncio.sleep(RETRY_BACKOFF_S * attempt)  # Serve learns of the loss
                # NOTE: a fresh engine request id per attempt: deltas the lost
                # replica still sends for the old id meet no collector, so a stream
                # never mixes two replicas' deltas.
                request = msgspec.structs.replace(
                    request, request_id=f"{self._base_id}{RETRY_ID_SEP}{attempt}")
                self.request_id = request.request_id
                self._collector = self._hub.register(request.request_id)
            last = attempt + 1 == MAX_ADMISSION_ATTEMPTS
            self._call = engine_stream.generate.remote(encode_request(request))
            try:
                replica_id = await self._call.__anext__()
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                cause = replica_cause(e)
                dead_engine = isinstance(cause, ReplicaUnavailable) and cause.replica_id
                if not dead_engine:
                    self.num_replica_losses += is_replica_lost(e)
                if (last or not is_replica_lost(e)
                        or self.num_replica_losses > max_replica_loss_retries):
                    raise replica_error(e) from None
                logger.warning("engine replica %s lost %s before admitting it (%s): trying "
                               "another", dead_engine or "(unknown)", request.request_id,
                               type(cause).__name__)
                if dead_engine:
                    avoid_replica(dead_engine)  # its engine died; the actor still answers
                self._forget_attempt()
                continue
            self._hub.attach(request.request_id, replica_id)
            self._replica_id = replica_id
            self._watcher = asyncio.create_task(self._watch())
            first = await self._collector.get()
            if first.finish_reason != FinishReason.ERROR:
                self._first = first
                return
            # no header went out yet: a replica lost now is retried elsewhere
            if not self._lost_its_replica():
                raise self._failure or ApiError(500, f"The request failed: {first.error}",
                                                code="engine_error")
            self.num_replica_losses += 1
            if last or self.num_replica_losses > max_replica_loss_retries:
                raise self._failure or ApiError(
                    503, "The engine replica was lost before the first token; retry later",
                    code="engine_unavailable", retry_after_s=1.0)
            logger.warning("engine replica %s was lost before %s's first token: trying "
                           "another", replica_id, request.request_id)
            avoid_replica(replica_id)
            self._forget_attempt()

    def _lost_its_replica(self) -> bool:
        """Whether the error delta just read came from losing the replica (its actor
        died or cannot be reached), not from the engine failing the request."""
        return self._hub.lost_its_channel(self.request_id) or (
            self._failure_cause is not None and is_replica_lost(self._failure_cause))

    def _forget_attempt(self) -> None:
        """Drop an attempt that failed before its first token, so the next starts
        clean (its own collector, call and watcher)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._call is not None:
            self._call.cancel()
        self._failure = self._failure_cause = None
        self._hub.forget(self.request_id)

    async def text_deltas(self, index: int | None = None) -> AsyncIterator[TextDelta]:
        """Text deltas until one carries a finish reason (STOP, LENGTH, ABORT or
        ERROR with `.error`). Close it (`contextlib.aclosing`) when done early.
        `index` given: (index, text delta) pairs, what `merged_text_deltas` yields."""
        delta = self._first
        assert delta is not None, "Relay.open first"
        timer = None
        if delta.finish_reason is None and self._timeout_s is not None:
            # NOTE: one timer per request, nothing per delta.
            delay = (self._timeout_s if self._deadline is None
                     else max(0.0, self._deadline - time.monotonic()))
            timer = asyncio.get_running_loop().call_later(delay, self._time_out)
        engine_done = False
        try:
            while True:
                engine_done = delta.finish_reason is not None
                if (engine_done and delta.finish_reason == FinishReason.ERROR
                        and self._lost_its_replica()):
                    self.replica_lost = True
                    avoid_replica(self._replica_id)  # a retry goes elsewhere
                    # NOTE: an unreachable replica may still run it: abort it there
                    engine_done = False
                text_delta = self._text_stream.push(delta)
                yield text_delta if index is None else (index, text_delta)
                if text_delta.finish_reason is not None:
                    return
                delta = await self._collector.get()
        finally:
            if timer is not None:
                timer.cancel()
            self._close(engine_done and not self.timed_out)

    def abort(self) -> None:
        """Stop an open request whose deltas will not be read (another choice of
        its request was refused, or its response ended before reading them). Once
        the relay is closed (its deltas read to the end, or closed early) it does
        nothing."""
        self._close(engine_done=False)

    def _close(self, engine_done: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if not engine_done and self._call is not None:  # stop string, disconnect, timeout
            self._call.cancel()
        self._hub.forget(self.request_id)

    def _time_out(self) -> None:
        self.timed_out = True
        self._collector.put_error(f"the request timed out after {self._timeout_s:g} s")

    async def _watch(self) -> None:
        """Wait for the admission call to end; fail the request if it failed."""
        try:
            async for _ in self._call:
                pass
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the replica died, or the call was refused late
            self._failure, self._failure_cause = replica_error(e), e
            self._collector.put_error(self._failure.message)
            return
        await asyncio.sleep(_FINISH_GRACE_S)
        self._collector.put_error("the engine ended the request without a finish")


def is_error(text_delta: TextDelta) -> bool:
    return text_delta.finish_reason == FinishReason.ERROR


aclosing = contextlib.aclosing
