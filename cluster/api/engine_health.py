"""The app's health as the ingress's /health reports it: every engine replica's.

A call through the engine's Serve handle lands on one replica at random: with one
unhealthy replica of two, /health would flip between 200 and 503, and a load
balancer would pull a healthy ingress. So each check lists the engine deployment's
replicas (Serve's controller, cluster/transport/ray_internals.py) and asks each one
directly, as the channels and the tests' stats do (a pinned call,
cluster/transport/routing.py), all at once, each for at most `timeout_s`. The app is
healthy while any replica is; the answer names the others and why.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.responses import JSONResponse

from cluster.errors import ApiError

logger = logging.getLogger("ray.serve")

HEALTH_CALL_TIMEOUT_S = 10.0
# NOTE: Serve routes no call to a replica in these states, so a pinned call would wait
# out its timeout: a replica still loading its model would slow every check by that.
_NOT_ROUTED = frozenset({"STARTING", "STOPPING", "STOPPED"})

ListReplicas = Callable[[], Awaitable[dict[str, str]]]  # replica id -> Serve state


@dataclass(slots=True, frozen=True)
class EngineHealth:
    healthy_replica_ids: tuple[str, ...] = ()
    unhealthy_replicas: dict[str, str] = field(default_factory=dict)  # replica id -> why
    error: str | None = None  # why no replica is known

    @property
    def is_healthy(self) -> bool:
        return bool(self.healthy_replica_ids)

    def as_dict(self) -> dict:
        """The fields of the answer (a 503's `error.message` also says `error`)."""
        return {"status": "ok" if self.is_healthy else "unhealthy",
                "num_healthy_replicas": len(self.healthy_replica_ids),
                "num_replicas": len(self.healthy_replica_ids) + len(self.unhealthy_replicas),
                "unhealthy_replicas": dict(self.unhealthy_replicas)}

    def response(self) -> JSONResponse:
        """200 while any engine replica serves; else 503 in the OpenAI error shape, with
        the same fields beside it."""
        if self.is_healthy:
            return JSONResponse(self.as_dict())
        why = self.error or ", ".join(f"{rid}: {e}" for rid, e in self.unhealthy_replicas.items())
        error = ApiError(503, f"engine unhealthy: no healthy engine replica ({why})",
                         code="engine_unavailable")
        return JSONResponse({**error.body(), **self.as_dict()}, status_code=503)


async def _await(response) -> object:
    return await response


async def _ask(engine: Any, replica_id: str, timeout_s: float) -> str | None:
    """None if the replica says it is healthy within `timeout_s`, else why not."""
    response = engine.health.remote(pin_replica_id=replica_id)
    try:
        await asyncio.wait_for(_await(response), timeout=timeout_s)
    except Exception as e:
        if isinstance(e, TimeoutError):
            response.cancel()  # NOTE: else the pinned call waits on in the router
        # NOTE: the exception's type only: /health is open without a key
        return type(e).__name__
    return None


class EngineHealthCheck:
    """Checks every replica of one engine deployment; remembers the last replica list,
    so a controller briefly away (it restarts; Serve keeps serving) keeps /health up."""

    def __init__(self, engine: Any, timeout_s: float = HEALTH_CALL_TIMEOUT_S,
                 list_replicas: ListReplicas | None = None) -> None:
        self._engine = engine
        self._timeout_s = timeout_s
        self._list_replicas = list_replicas or self._serve_replica_states
        self._states: dict[str, str] = {}
        self._is_listing_failing = False
        self._last_logged: tuple[str | None, dict[str, str]] = (None, {})

    async def run(self) -> EngineHealth:
        try:
            self._states = await asyncio.wait_for(self._list_replicas(), self._timeout_s)
            self._is_listing_failing = False
        except Exception as e:
            if not self._is_listing_failing:
                logger.warning("could not list the engine replicas: %r", e)
            self._is_listing_failing = True
            if not self._states:
                return self._log(EngineHealth(error=f"no engine replica known "
                                                    f"({type(e).__name__})"))
        asked = [rid for rid, state in self._states.items() if state not in _NOT_ROUTED]
        answers = await asyncio.gather(*(_ask(self._engine, rid, self._timeout_s)
                                         for rid in asked))
        unhealthy = {rid: state for rid, state in self._states.items() if state in _NOT_ROUTED}
        unhealthy.update((rid, why) for rid, why in zip(asked, answers) if why is not None)
        healthy = tuple(rid for rid, why in zip(asked, answers) if why is None)
        return self._log(EngineHealth(healthy, unhealthy,
                                      None if self._states else "no engine replica known"))

    def _log(self, health: EngineHealth) -> EngineHealth:
        # NOTE: on a change only: /health may be checked every second for days
        logged = (health.error, health.unhealthy_replicas)
        if logged != self._last_logged:
            self._last_logged = logged
            logger.warning("engine health: %s%s", health.as_dict(),
                           f" ({health.error})" if health.error else "")
        return health

    async def _serve_replica_states(self) -> dict[str, str]:
        from cluster.transport.ray_internals import replica_states

        return await replica_states(self._engine.app_name, self._engine.deployment_name)
