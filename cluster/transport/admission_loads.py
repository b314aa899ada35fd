"""How many requests one router has sent to each engine replica and not yet seen
finish: the load its admissions are balanced on.

Why its own count and not Serve's queue-length cache: in a burst (many requests
arriving at once), the cache holds what replicas reported a moment ago, before
the burst's own admissions reached them, so Serve's power of two choices sent most
of a burst to one replica (docs/performance.md, "Balancing a burst"): that
replica's streams finish last and the run waits for them. This count moves the
moment a request is chosen.

A request counts from the moment it is chosen (a reservation), then from its
acceptance until its admission call ends. A reservation lapses after
`reservation_s` in case the request is never sent (cancelled while it was routed):
long, because a replica busy with a large prefill may take seconds to accept, and
a reservation lapsed before that would make it look idle. Pure Python: the router
(cluster/transport/routing.py) feeds it request and replica ids.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable

RESERVATION_S = 30.0


class AdmissionLoads:
    """NOTE: every operation is O(1) (amortized), whatever the requests in flight: it
    runs for every admission of a burst of thousands."""

    def __init__(self, reservation_s: float = RESERVATION_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reservation_s = reservation_s
        self._clock = clock
        self._reserved: dict[str, tuple[str, float]] = {}  # request id -> (replica id, when)
        self._num_reserved: Counter[str] = Counter()  # replica id -> reservations
        self._reservation_order: deque[tuple[float, str]] = deque()  # (when, request id)
        self._routed: dict[str, str] = {}  # request id -> replica id
        self._num_routed: Counter[str] = Counter()  # replica id -> routed requests

    def reserve(self, request_id: str, replica_id: str) -> None:
        """`request_id` was chosen for `replica_id` (again, on a retry: the last wins)."""
        self._unreserve(request_id)
        now = self._clock()
        self._reserved[request_id] = (replica_id, now)
        self._num_reserved[replica_id] += 1
        self._reservation_order.append((now, request_id))

    def routed(self, request_id: str, replica_id: str) -> None:
        """`replica_id` accepted it: it counts there until `completed`. A request
        never reserved (not an admission) is not counted."""
        if request_id not in self._reserved and request_id not in self._routed:
            return
        self._unreserve(request_id)
        if request_id in self._routed:
            _decrement(self._num_routed, self._routed[request_id])
        self._routed[request_id] = replica_id
        self._num_routed[replica_id] += 1

    def completed(self, request_id: str, replica_id: str) -> None:
        """Its call to `replica_id` ended (done, failed, cancelled or refused).

        NOTE: a call `replica_id` refused (its queue was full) may end after the
        request was chosen again, for another replica: that newer choice stays."""
        reserved = self._reserved.get(request_id)
        if reserved is not None and reserved[0] == replica_id:
            self._unreserve(request_id)
        if self._routed.get(request_id) == replica_id:
            del self._routed[request_id]
            _decrement(self._num_routed, replica_id)

    def of(self, replica_ids: list[str]) -> dict[str, int]:
        """Each replica's load: routed requests plus reservations still fresh."""
        self._lapse(self._clock() - self._reservation_s)
        return {rid: self._num_routed.get(rid, 0) + self._num_reserved.get(rid, 0)
                for rid in replica_ids}

    @property
    def num_tracked(self) -> int:
        """Requests reserved or routed (what it holds: bounded by those in flight)."""
        return len(self._reserved) + len(self._routed)

    def _unreserve(self, request_id: str) -> None:
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:
            _decrement(self._num_reserved, reserved[0])

    def _lapse(self, oldest: float) -> None:
        order = self._reservation_order
        while order and order[0][0] < oldest:
            at, request_id = order.popleft()
            reserved = self._reserved.get(request_id)
            if reserved is not None and reserved[1] == at:  # not chosen again since
                self._unreserve(request_id)
        # NOTE: entries of reservations that ended meanwhile wait here until they
        # lapse: at most the reservations of the last `reservation_s`.


def _decrement(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
