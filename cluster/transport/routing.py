"""Request routing to engine replicas: pinning, then prefix homes and load.

- A channel call (and a unary call that names its replica) carries
  `pin_replica_id`: the per-step channel of an ingress belongs to the replica that
  admitted its requests.
- An admission call carries an encoded `EngineRequest` (cluster/transport/wire.py):
  its prompt's first blocks go to the replica that holds them, unless it is much
  busier, else to the least loaded of the nearest replicas
  (cluster/transport/prefix_affinity.py). Load is what this router sent and has not
  seen finish (cluster/transport/admission_loads.py), exact the moment a request is
  chosen, where Serve's queue-length cache lags a burst.
- Everything else is Serve's own power of two choices.

An admission call avoids a replica whose engine was found dead for a while
(cluster/transport/replica_avoidance.py). If every replica is avoided, all stay candidates.

This is Serve's request-router extension point (`request_router_config`), so
routing keeps Serve's queue-length probing, backoff, queue bounds and replica
bookkeeping: a chosen replica whose queue is full is passed over for the next
rank. A pinned call waits (with Serve's backoff) while its replica is not among
the running ones; the ingress bounds that wait (see cluster/transport/channels.py).
"""
from __future__ import annotations

import random

from ray.serve.request_router import (FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest,
                                      RequestRouter, RunningReplica)

from cluster.transport.admission_loads import AdmissionLoads
from cluster.transport.prefix_affinity import PrefixHomes, choose, prefix_key
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
        """`prefix_tokens` 0 turns prefix homes off (admissions go by load only)."""
        self._prefix_tokens = prefix_tokens
        self._block_size = block_size
        self._imbalance_threshold = imbalance_threshold
        self._loads = AdmissionLoads()
        self._homes = PrefixHomes()

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
            prompt = prompt_of(pending_request.args[0]) if pending_request.args else None
            if prompt is not None:
                return self._admission_ranks(_not_avoided(candidate_replicas), pending_request,
                                             prompt)
        return self._two_choices(candidate_replicas, pending_request)

    def _admission_ranks(self, candidates: list[RunningReplica], pending_request: PendingRequest,
                         prompt: list[int]) -> list[list[RunningReplica]]:
        """[the chosen replica], then the rest of the nearest (if its queue is full)."""
        if not candidates:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        near = self._nearest(candidates, pending_request)
        near_ids = [r.replica_id.unique_id for r in near]
        key = (prefix_key(prompt, self._prefix_tokens, self._block_size)
               if self._prefix_tokens else None)
        chosen = choose(key, self._homes, list(by_id), near_ids, self._loads.of(list(by_id)),
                        self._imbalance_threshold)
        self._loads.reserve(pending_request.metadata.internal_request_id, chosen)
        rest = [r for r in near if r.replica_id.unique_id != chosen]
        return [[by_id[chosen]]] + ([two_of(rest)] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id,
                          result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        # NOTE: only admissions were reserved: other calls are ignored there, without
        # decoding their arguments again
        self._loads.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._loads.completed(internal_request_id, replica_id.unique_id)

    def _nearest(self, candidates: list[RunningReplica],
                 pending_request: PendingRequest | None) -> list[RunningReplica]:
        """This node's candidates, else this zone's, else all (Serve's locality ranks)."""
        by_id = {r.replica_id.unique_id: r for r in candidates}
        near = [by_id[i.unique_id] for i in self.apply_locality_routing(pending_request=pending_request)
                if i.unique_id in by_id]
        return near or candidates

    def _two_choices(self, candidates: list[RunningReplica],
                     pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Two of the nearest candidates, as Serve's own router draws them."""
        chosen = two_of(self._nearest(candidates, pending_request))
        return [chosen] if chosen else []

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        # NOTE: a replica chosen for one request (its pin, its prefix, not an avoided
        # one) goes to that very request. Serve's FIFO policy would hand it to
        # whichever request is first in the queue: a channel pinned to replica A
        # could then open on replica B.
        fulfill_with_chosen_replica(self, replica, request_metadata)


ROUTER_PATH = f"{PinnedRouter.__module__}.{PinnedRouter.__name__}"
