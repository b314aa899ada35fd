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
from collections import Counter
from typing import Callable

RESERVATION_S = 30.0


class AdmissionLoads:
    def __init__(self, reservation_s: float = RESERVATION_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reservation_s = reservation_s
        self._clock = clock
        self._reserved: dict[str, tuple[str, float]] = {}  # request id -> (replica id, when)
        self._routed: dict[str, str] = {}  # request id -> replica id
        self._num_routed: Counter[str] = Counter()  # replica id -> routed requests

    def reserve(self, request_id: str, replica_id: str) -> None:
        """`request_id` was chosen for `replica_id` (again, on a retry: the last wins)."""
        self._reserved[request_id] = (replica_id, self._clock())

    def routed(self, request_id: str, replica_id: str) -> None:
        """`replica_id` accepted it: it counts there until `completed`."""
        self._reserved.pop(request_id, None)
        if request_id in self._routed:
            self._num_routed[self._routed[request_id]] -= 1
        self._routed[request_id] = replica_id
        self._num_routed[replica_id] += 1

    def completed(self, request_id: str, replica_id: str) -> None:
        """Its call to `replica_id` ended (done, failed, cancelled or refused).

        NOTE: a call `replica_id` refused (its queue was full) may end after the
        request was chosen again, for another replica: that newer choice stays."""
        reserved = self._reserved.get(request_id)
        if reserved is not None and reserved[0] == replica_id:
            del self._reserved[request_id]
        if self._routed.get(request_id) == replica_id:
            del self._routed[request_id]
            self._num_routed[replica_id] -= 1
            if not self._num_routed[replica_id]:
                del self._num_routed[replica_id]

    def of(self, replica_ids: list[str]) -> dict[str, int]:
        """Each replica's load: routed requests plus reservations still fresh."""
        loads = {rid: self._num_routed.get(rid, 0) for rid in replica_ids}
        oldest = self._clock() - self._reservation_s
        lapsed = []
        for request_id, (replica_id, at) in self._reserved.items():
            if at < oldest:
                lapsed.append(request_id)
            elif replica_id in loads:
                loads[replica_id] += 1
        for request_id in lapsed:
            del self._reserved[request_id]
        return loads

    @property
    def num_tracked(self) -> int:
        """Requests reserved or routed (what it holds: bounded by those in flight)."""
        return len(self._reserved) + len(self._routed)
