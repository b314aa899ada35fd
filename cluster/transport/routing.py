"""Request routing to engine replicas: pinning, prefix affinity, then Serve's
power of two choices.

- A channel call (and a unary call that names its replica) carries
  `pin_replica_id`: the per-step channel of an ingress belongs to the replica that
  admitted its requests.
- An admission call carries an encoded `EngineRequest` (cluster/transport/wire.py): its
  prompt's first blocks pick a preferred replica (cluster/transport/prefix_affinity.py), where the
  prefix's KV blocks are likely cached, unless that replica is much busier.
- Everything else, and the fallback, is Serve's own power of two choices.

An admission call avoids a replica whose engine was found dead for a while
(cluster/transport/replica_avoidance.py). If every replica is avoided, all stay candidates.

This is Serve's request-router extension point (`request_router_config`), so
routing keeps Serve's queue-length probing, backoff, queue bounds and replica
bookkeeping. A pinned call waits (with Serve's backoff) while its replica is not
among the running ones; the ingress bounds that wait (see cluster/transport/channels.py).
"""
from __future__ import annotations

import random

from ray.serve.request_router import (FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest,
                                      RequestRouter, RunningReplica)

from cluster.transport.prefix_affinity import choose, prefix_key
from cluster.transport.ray_internals import fulfill_with_chosen_replica
from cluster.transport.wire import prompt_of

PIN_KWARG = "pin_replica_id"


def _not_avoided(candidates: list[RunningReplica]) -> list[RunningReplica]:
    from cluster.transport import replica_avoidance  # NOTE: at call time (see its docstring)

    if not replica_avoidance.any_avoided():
        return candidates
    keep = [r for r in candidates if not replica_avoidance.is_avoided(r.replica_id.unique_id)]
    return keep or candidates


def two_of(candidates: list[RunningReplica]) -> list[RunningReplica]:
    """Two distinct candidates at random (all of them, shuffled, when fewer): Serve's
    power of two choices, whose base router then takes the shorter queue."""
    return random.sample(candidates, min(2, len(candidates)))


class PinnedRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, prefix_tokens: int = 0, block_size: int = 16,
                         imbalance_threshold: int = 8, **kwargs) -> None:
        """`prefix_tokens` 0 turns prefix affinity off."""
        self._prefix_tokens = prefix_tokens
        self._block_size = block_size
        self._imbalance_threshold = imbalance_threshold

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pin = pending_request.kwargs.get(PIN_KWARG)
            if pin is not None:
                # NOTE: Serve retries at once, without awaiting, unless told to back
                # off: a pin whose replica is not running yet (or any more) would spin
                # the router's event loop, which then never learns of new replicas.
                pending_request.routing_context.should_backoff = True
                return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
            allowed = _not_avoided(candidate_replicas)
            preferred = self._prefix_choice(allowed, pending_request)
            rest = self._two_choices(allowed, pending_request)
            if preferred is not None:
                # NOTE: a second rank: if the preferred replica refuses (its queue is
                # full), the usual choice among the rest follows.
                return [[preferred]] + rest
            return rest
        return self._two_choices(candidate_replicas, pending_request)

    def _two_choices(self, candidates: list[RunningReplica],
                     pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Two of the nearest candidates (this node's, then this zone's, then all, as
        Serve's locality policy ranks them), as Serve's own router draws them."""
        by_id = {r.replica_id.unique_id: r for r in candidates}
        near = [by_id[i.unique_id] for i in self.apply_locality_routing(pending_request=pending_request)
                if i.unique_id in by_id]
        chosen = two_of(near or candidates)
        return [chosen] if chosen else []

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        # NOTE: a replica chosen for one request (its pin, its prefix, not an avoided
        # one) goes to that very request. Serve's FIFO policy would hand it to
        # whichever request is first in the queue: a channel pinned to replica A
        # could then open on replica B.
        fulfill_with_chosen_replica(self, replica, request_metadata)

    def _prefix_choice(self, candidates: list[RunningReplica],
                       pending_request: PendingRequest) -> RunningReplica | None:
        if not getattr(self, "_prefix_tokens", 0) or len(candidates) < 2:
            return None
        args = pending_request.args
        prompt = prompt_of(args[0]) if args else None
        if prompt is None:
            return None
        key = prefix_key(prompt, self._prefix_tokens, self._block_size)
        by_id = {r.replica_id.unique_id: r for r in candidates}
        cache = self.replica_queue_len_cache
        queue_lens = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        chosen = choose(key, list(by_id), queue_lens, self._imbalance_threshold)
        return None if chosen is None else by_id[chosen]


ROUTER_PATH = f"{PinnedRouter.__module__}.{PinnedRouter.__name__}"
