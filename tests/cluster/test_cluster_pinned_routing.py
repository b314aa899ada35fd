"""The pinned branch of PinnedRouter, without Ray: a pin picks exactly its replica,
and a pin whose replica is not running asks Serve to back off between attempts
(otherwise Serve's routing loop retries without yielding and freezes the router)."""
import asyncio
from types import SimpleNamespace

from cluster.transport.routing import PIN_KWARG, PinnedRouter
from cluster.transport.wire import EngineRequest, encode_request
from replicas.config import SamplingParams


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


def _admission(prompt=(5, 6, 7), request_id="rid"):
    wire = encode_request(EngineRequest(request_id, list(prompt), SamplingParams(), "owner"))
    return SimpleNamespace(kwargs={}, args=(wire,),
                           metadata=SimpleNamespace(internal_request_id=request_id),
                           routing_context=SimpleNamespace(should_backoff=False))


def _router(*near, prefix_tokens=0):
    """A router whose locality policy names `near` (Serve's answer when they are all
    on this node)."""
    router = object.__new__(PinnedRouter)
    router.initialize_state(prefix_tokens=prefix_tokens)
    router.apply_locality_routing = lambda pending_request=None: [r.replica_id for r in near]
    return router


def test_admissions_avoid_a_replica_whose_engine_died(monkeypatch):
    from cluster.transport import replica_avoidance

    monkeypatch.setattr(replica_avoidance, "_avoided_until", {})
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    router = _router(a, b, c)
    replica_avoidance.avoid_replica("b")
    for i in range(20):
        ranks = asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission(request_id=f"r{i}")))
        assert b not in [r for rank in ranks for r in rank] and ranks[0]
    # a pin still reaches it (its own channel), and when every replica is avoided
    # they all stay candidates
    assert _choose([a, b, c], _pending("b")) == [[b]]
    for rid in ("a", "c"):
        replica_avoidance.avoid_replica(rid)
    # ... so b, the least loaded (the 20 before went to a and c), is chosen again
    chosen = {asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission(
        request_id=f"s{i}")))[0][0].replica_id.unique_id for i in range(6)}
    assert chosen == {"b"}


def test_admissions_go_to_the_least_loaded_and_a_full_choice_falls_back_to_the_rest():
    """Each choice counts at once (a burst spreads evenly before any replica
    answers); a request counts until its call ends; the second rank is the rest."""
    a, b = _replica("a"), _replica("b")
    router = _router(a, b)
    counts = {"a": 0, "b": 0}
    went_to = {}
    for i in range(10):
        ranks = asyncio.run(PinnedRouter.choose_replicas(router, [a, b], _admission(request_id=f"r{i}")))
        first, rest = ranks
        assert len(first) == 1 and rest == [b if first[0] is a else a]
        counts[first[0].replica_id.unique_id] += 1
        went_to[f"r{i}"] = first[0]
        router.on_request_routed(_admission(request_id=f"r{i}"), first[0].replica_id, None)
    assert counts == {"a": 5, "b": 5}
    for i in range(0, 10, 2):  # five of them finish; the replica that lost more gets the next
        router.on_request_completed(went_to[f"r{i}"].replica_id, f"r{i}")
    loads = router._loads.of(["a", "b"])
    nxt = asyncio.run(PinnedRouter.choose_replicas(router, [a, b], _admission(request_id="n")))[0][0]
    assert loads[nxt.replica_id.unique_id] == min(loads.values())


def test_a_shared_prefix_goes_home():
    a, b = _replica("a"), _replica("b")
    router = _router(a, b, prefix_tokens=64)
    system = list(range(100, 180))
    first = asyncio.run(PinnedRouter.choose_replicas(router, [a, b], _admission(system + [1], "p0")))
    for i in range(1, 6):
        ranks = asyncio.run(PinnedRouter.choose_replicas(router, [a, b], _admission(system + [i], f"p{i}")))
        assert ranks[0] == first[0]


def test_the_two_choices_prefer_the_nearest_replicas():
    """Serve's locality policy names this node's replicas first: admissions are
    balanced among them, and among all when it names none of the candidates."""
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    router = _router(c)
    for i in range(10):
        assert asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission(request_id=f"r{i}"))) == [[c]]
    router = _router(_replica("gone"))
    chosen = {asyncio.run(PinnedRouter.choose_replicas(router, [a, b, c], _admission(
        request_id=f"r{i}")))[0][0].replica_id.unique_id for i in range(3)}
    assert chosen == {"a", "b", "c"}


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
