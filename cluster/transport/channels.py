"""The ingress side of the per-step channel: one stream per engine replica.

Each request registers a `LoopCollector` (deltas/collector.py) under its id before it is admitted;
once a replica admitted it, the request is attached to that replica's channel,
which this hub opens on first use (pinned to the replica by
`cluster.transport.routing.PinnedRouter`). Every step message is demultiplexed into the
collectors of the requests it carries; the SSE writers drain their collectors
as before, so a writer that falls behind still gets one merged delta.

A channel ends when its replica closes it for idleness (reopened at once if
requests are still attached), or fails when the replica dies: every request
attached to it then ends with an error delta, and requests on other replicas
carry on.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

from cluster.errors import is_replica_lost, replica_cause_message
from cluster.transport.routing import PIN_KWARG
from cluster.transport.wire import decode_step
from deltas.collector import LoopCollector

logger = logging.getLogger("ray.serve")


class ChannelHub:
    def __init__(self, channel_handle, owner: str, owner_handle: Any = None,
                 open_timeout_s: float = 60.0) -> None:
        """`channel_handle`: a streaming handle to the engine deployment."""
        self.owner = owner
        self._handle = channel_handle
        self._owner_handle = owner_handle
        self._open_timeout_s = open_timeout_s
        self._collectors: dict[str, LoopCollector] = {}
        self._replica_of: dict[str, str] = {}  # request id -> replica id
        self._attached: dict[str, set[str]] = {}  # replica id -> unfinished request ids
        self._channels: dict[str, asyncio.Task] = {}
        # requests failed because their channel failed (the replica, not the request)
        self._channel_lost: set[str] = set()
        self.num_channels_opened = 0

    def register(self, request_id: str) -> LoopCollector:
        collector = self._collectors[request_id] = LoopCollector(request_id)
        return collector

    def attach(self, request_id: str, replica_id: str) -> None:
        """The request was admitted by `replica_id`: its deltas come on that channel."""
        if request_id not in self._collectors:
            return  # already forgotten (the consumer left while admission ran)
        self._replica_of[request_id] = replica_id
        self._attached.setdefault(replica_id, set()).add(request_id)
        if replica_id not in self._channels:
            # NOTE: a fresh context: a task started inside a request's context would
            # be cancelled with that request.
            self._channels[replica_id] = asyncio.get_running_loop().create_task(
                self._run(replica_id), context=contextvars.Context())

    def forget(self, request_id: str) -> None:
        self._collectors.pop(request_id, None)
        self._channel_lost.discard(request_id)
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            attached = self._attached.get(replica_id)
            if attached is not None:
                attached.discard(request_id)

    def lost_its_channel(self, request_id: str) -> bool:
        """Whether the request was failed by its channel's failure (its replica died
        or could not be reached), not by its engine."""
        return request_id in self._channel_lost

    @property
    def num_open_channels(self) -> int:
        return len(self._channels)

    async def _run(self, replica_id: str) -> None:
        try:
            while self._attached.get(replica_id):
                await self._stream(replica_id)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the replica died or cannot be reached
            self._fail(replica_id, e)
        finally:
            del self._channels[replica_id]
            if not self._attached.get(replica_id):
                self._attached.pop(replica_id, None)

    async def _stream(self, replica_id: str) -> None:
        gen = self._handle.channel.remote(self.owner, owner_handle=self._owner_handle,
                                          **{PIN_KWARG: replica_id})
        self.num_channels_opened += 1
        try:
            await asyncio.wait_for(gen.__anext__(), self._open_timeout_s)  # the greeting
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            gen.cancel()
            raise TimeoutError(f"no channel to engine replica {replica_id} within "
                               f"{self._open_timeout_s:g} s") from None
        collectors = self._collectors
        attached = self._attached[replica_id]
        async for message in gen:
            for delta in decode_step(message):
                collector = collectors.get(delta.request_id)
                if collector is None:
                    continue  # the consumer left; the replica aborts it
                if delta.finish_reason is not None:
                    attached.discard(delta.request_id)
                collector.put(delta)

    def _fail(self, replica_id: str, exc: BaseException) -> None:
        message = replica_cause_message(exc)
        lost = is_replica_lost(exc)  # the replica, not a refusal or a bug of ours
        request_ids = self._attached.pop(replica_id, set())
        logger.warning("channel to engine replica %s failed (%s); failing %d requests",
                       replica_id, message, len(request_ids))
        for request_id in request_ids:
            collector = self._collectors.get(request_id)
            if collector is not None:
                if lost:
                    self._channel_lost.add(request_id)
                collector.put_error(message)
