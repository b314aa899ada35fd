"""The pinned branch of PinnedRouter, without Ray: a pin picks exactly its replica,
and a pin whose replica is not running asks Serve to back off between attempts
(otherwise Serve's routing loop retries without yielding and freezes the router)."""
import asyncio
from types import SimpleNamespace

from cluster.routing import PIN_KWARG, PinnedRouter


def _replica(unique_id: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


def _pending(pin: str):
    return SimpleNamespace(kwargs={PIN_KWARG: pin}, args=(),
                           routing_context=SimpleNamespace(should_backoff=False))


def _choose(candidates, pending):
    router = object.__new__(PinnedRouter)  # the pinned branch needs no router state
    return asyncio.run(PinnedRouter.choose_replicas(router, candidates, pending))


def test_a_pin_picks_exactly_its_replica():
    a, b = _replica("a"), _replica("b")
    pending = _pending("b")
    assert _choose([a, b], pending) == [[b]]
    assert pending.routing_context.should_backoff


def test_a_pin_to_a_replica_not_running_backs_off():
    pending = _pending("starting")
    assert _choose([_replica("a")], pending) == [[]]
    assert pending.routing_context.should_backoff
