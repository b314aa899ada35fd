"""The ingress's own bound on requests that have no first token yet.

A request costs the ingress's event loop most before its first token: reading and
parsing the body, the chat template and tokenizing, Serve's routing and queueing.
That loop also forwards every admitted stream's deltas, so a burst far past what
the engines can hold would starve the streams already running (and each request
timing out in the queue would let in another that times out in turn). The gate
counts this replica's requests between their body's arrival and their first token
(or their refusal) and turns away the rest before any of that work: 429 +
Retry-After, at the cost of a counter check (`check`, before the body is read).
A body is read before its request takes a slot, under a deadline
(`body_timeout_s`): a client trickling its body holds its own connection, not a
slot every client needs.

Its default bound (`AppArgs.ingress_max_pending`) is what the engine replicas admit
at once (running and waiting, at the autoscaling maximum), split over the ingress
replicas: a request past it could only wait in Serve's queue.
"""
from __future__ import annotations

from cluster.errors import ApiError

RETRY_AFTER_S = 1.0


class PendingGate:
    def __init__(self, limit: int | None) -> None:
        """`limit`: requests without a first token at most; None: unbounded."""
        self.limit = limit
        self.num_pending = 0
        self.num_refused = 0

    def check(self) -> None:
        """Raise the 429 `enter` would raise now, counting nothing in."""
        if self.limit is not None and self.num_pending >= self.limit:
            self._refuse()

    def enter(self) -> None:
        """Count a new request in, or raise a 429 ApiError if the bound is reached."""
        if self.limit is not None and self.num_pending >= self.limit:
            self._refuse()
        self.num_pending += 1

    def _refuse(self) -> None:
        self.num_refused += 1
        raise ApiError(
            429, f"The server is busy: {self.num_pending} requests are waiting for their "
            "first token on this ingress replica (ingress_max_pending_requests); retry "
            "later", code="rate_limit_exceeded", retry_after_s=RETRY_AFTER_S)

    def leave(self) -> None:
        """The request got its first token, or an answer without one."""
        self.num_pending -= 1
