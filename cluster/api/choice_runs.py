"""The runs of one request's choices (`n` for each of its prompts): the first, and
one more where a non-streamed answer lost its engine replica mid-answer
(cluster/api/response_writer.py).

A run again opens every choice anew under engine request ids of its own
(`<id>~r<run>`, its choices `<id>~r<run>-<i>`), so whatever the lost replica still
sends for the old ids reaches no collector. It is the same request still:
- it counts against the ingress's pending bound while it waits for its first token
  (a replica lost with many answers must not let them all back in uncounted);
- it keeps the request's timeout: the request ends `request_timeout_s` after the
  first run's first token, the run again's queueing included (past it: 504);
- it shares the request's one retry after a lost replica
  (cluster/transport/relay.py): a run again is never retried itself, so a request
  that takes its replica down takes one more at most.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from cluster.api.choices import choice_requests, open_relays
from cluster.api.pending_gate import PendingGate
from cluster.errors import ApiError
from cluster.transport.channels import ChannelHub
from cluster.transport.relay import RETRY_ID_SEP, Relay
from replicas.config import SamplingParams  # plain data: no torch


class ChoiceRuns:
    def __init__(self, engine_stream, hub: ChannelHub, request_id: str,
                 prompts: list[list[int]], params: SamplingParams, n: int,
                 new_text_stream: Callable[[], object], gate: PendingGate,
                 timeout_s: float | None, queue_timeout_s: float | None) -> None:
        self._engine_stream = engine_stream
        self._hub = hub
        self._request_id = request_id
        self._prompts = prompts
        self._params = params
        self._n = n
        self._new_text_stream = new_text_stream
        self._gate = gate
        self._timeout_s = timeout_s
        self._queue_timeout_s = queue_timeout_s
        self._first_token_at: float | None = None

    async def open(self) -> list[Relay]:
        """The first run's relays, once each choice has its first delta (the caller
        holds the request's place in the pending bound)."""
        relays = await self._open(self._request_id, self._queue_timeout_s)
        self._first_token_at = time.monotonic()
        return relays

    async def open_again(self, run: int) -> list[Relay]:
        """Run `run` (1, ...) of the choices, after the last one lost a replica."""
        assert self._first_token_at is not None, "open first"
        deadline = None
        queue_timeout_s = self._queue_timeout_s
        waits_past_deadline = False  # the request times out before its queue does
        if self._timeout_s is not None:
            deadline = self._first_token_at + self._timeout_s
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise self._timed_out()
            waits_past_deadline = left_s < (math.inf if queue_timeout_s is None
                                            else queue_timeout_s)
            if waits_past_deadline:
                queue_timeout_s = left_s
        self._gate.enter()
        try:
            return await self._open(f"{self._request_id}{RETRY_ID_SEP}r{run}", queue_timeout_s,
                                    max_replica_loss_retries=0, deadline=deadline)
        except ApiError as e:
            if waits_past_deadline and e.code == "queue_timeout":
                raise self._timed_out() from None
            raise
        finally:
            self._gate.leave()

    def _open(self, engine_id: str, queue_timeout_s: float | None, **relay_options):
        requests = choice_requests(engine_id, self._prompts, self._params, self._hub.owner,
                                   self._n)
        return open_relays(self._engine_stream, self._hub, requests, self._new_text_stream,
                           timeout_s=self._timeout_s, queue_timeout_s=queue_timeout_s,
                           n=self._n, **relay_options)

    def _timed_out(self) -> ApiError:
        return ApiError(504, f"The request timed out: its engine replica was lost while it "
                        f"ran, and the run again reached {self._timeout_s:g} s "
                        "(request_timeout_s)", code="timeout")
