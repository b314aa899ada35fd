"""The pinned branch of PinnedRouter, without Ray: a pin picks exactly its replica,
and a pin whose replica is not running asks Serve to back off between attempts
(otherwise Serve's routing loop retries without yielding and freezes the router)."""
import asyncio
from types import SimpleNamespace

from cluster.transport.routing import PIN_KWARG, PinnedRouter


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


def _admission(prompt=(5, 6, 7)):
    wire = ["rid", list(prompt), {}, "owner"]
    return SimpleNamespace(kwargs={}, args=(wire,),
                           routing_context=SimpleNamespace(should_backoff=False))


def test_admissions_avoid_a_replica_whose_engine_died(monkeypatch):
    from cluster.transport import replica_avoidance

    monkeypatch.setattr(replica_avoidance, "_avoided_until", {})
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    router = object.__new__(PinnedRouter)
    router._prefix_tokens = 0
    # NOTE: Serve's locality policy, as it answers with every replica on one node
    router.apply_locality_routing = lambda pending_request=None: [
        r.replica_id for r in (a, b, c)]
    replica_avoidance.avoid_replica("b")
    for _ in range(20):
        ranks = asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission()))
        assert b not in [r for rank in ranks for r in rank] and ranks[0]
    # a pin still reaches it (its own channel), and when every replica is avoided
    # they all stay candidates
    assert _choose([a, b, c], _pending("b")) == [[b]]
    replica_avoidance.avoid_replica("a")
    replica_avoidance.avoid_replica("c")
    seen = []

    def two_of(candidates):
        seen.append(candidates)
        return candidates[:2]
    # NOTE: the globals the method runs with: once Serve has loaded the router in
    # this process (another test module's app), its methods are by-value copies with
    # globals of their own (Serve pickles the router class by value).
    monkeypatch.setitem(PinnedRouter._two_choices.__globals__, "two_of", two_of)
    ranks = asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission()))
    assert seen == [[a, b, c]] and ranks == [[a, b]]


def test_the_two_choices_prefer_the_nearest_replicas():
    """Serve's locality policy names this node's replicas first: the two choices are
    drawn among them, and among all when it names none of the candidates."""
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    router = object.__new__(PinnedRouter)
    router._prefix_tokens = 0
    router.apply_locality_routing = lambda pending_request=None: [c.replica_id]
    for _ in range(10):
        assert asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission())) == [[c]]
    router.apply_locality_routing = lambda pending_request=None: [_replica("gone").replica_id]
    ranks = asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission()))
    assert len(ranks) == 1 and len(ranks[0]) == 2 and set(map(id, ranks[0])) <= {id(a), id(b), id(c)}


def test_a_chosen_replica_goes_to_the_request_it_was_chosen_for():
    """Serve's FIFO policy hands a chosen replica to the first request in the queue:
    a channel pinned to one replica could open on another. Ours matches exactly."""
    import concurrent.futures

    first = SimpleNamespace(future=concurrent.futures.Future(), rid="first")
    pinned = SimpleNamespace(future=concurrent.futures.Future(), rid="pinned")
    by_id = {"first": first, "pinned": pinned}
    router = object.__new__(PinnedRouter)
    router._pending_requests_to_fulfill = __import__("collections").deque([first, pinned])
    router._get_pending_request_matching_internal_request_id = lambda m: by_id.get(
        m.internal_request_id)
    router._cancel_routing_task_for_pending_request = lambda pr: None
    router._record_queue_wait_time = lambda pr: None
    router._remove_pending_request_from_indices = lambda pr: by_id.pop(pr.rid)
    replica = _replica("b")
    router._fulfill_next_pending_request(replica, SimpleNamespace(internal_request_id="pinned"))
    assert pinned.future.result(timeout=1) is replica and not first.future.done()
