"""Engine replicas the admissions of this process avoid for a while: those whose
engine was found dead (the ingress learns it from a refusal, cluster/transport/relay.py).
Such a replica answers at once, so queue-length probing would otherwise see it as
the least loaded until Serve replaces it.

NOTE: a module of its own, imported where it is used at call time: Serve may ship
the router class to the ingress by value, with a copy of its module's globals, so
a registry kept in cluster/transport/routing.py would not be the one the ingress writes to.
"""
from __future__ import annotations

import time

AVOID_S = 30.0
# replica unique id -> the monotonic time until which admissions avoid it
_avoided_until: dict[str, float] = {}


def avoid_replica(replica_id: str, seconds: float = AVOID_S) -> None:
    _avoided_until[replica_id] = time.monotonic() + seconds


def is_avoided(replica_id: str, now: float | None = None) -> bool:
    until = _avoided_until.get(replica_id)
    return until is not None and until > (time.monotonic() if now is None else now)


def any_avoided() -> bool:
    """Whether any replica is avoided now; expired entries are dropped."""
    if not _avoided_until:
        return False
    now = time.monotonic()
    for replica_id in [r for r, until in _avoided_until.items() if until <= now]:
        _avoided_until.pop(replica_id, None)
    return bool(_avoided_until)


def clear() -> None:
    _avoided_until.clear()
