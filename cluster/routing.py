"""Request routing to engine replicas: Serve's power of two choices, plus pinning.

A channel call names the replica it must reach (`pin_replica_id`): the per-step
channel of an ingress belongs to the replica that admitted its requests. Every
other call (admission, unary calls) is routed by Serve's own policy. This is
Serve's request-router extension point (`request_router_config`), so routing
keeps Serve's queue-length probing, backoff and replica bookkeeping.

A pinned call waits (with Serve's backoff) while its replica is not among the
running ones; the ingress bounds that wait (see `cluster/channels.py`).
"""
from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

PIN_KWARG = "pin_replica_id"


class PinnedRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        pin = pending_request.kwargs.get(PIN_KWARG) if pending_request is not None else None
        if pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        return await super().choose_replicas(candidate_replicas, pending_request)


ROUTER_PATH = f"{PinnedRouter.__module__}.{PinnedRouter.__name__}"
