"""Is the ingress replica behind a channel still alive? (replica side)

Ray does not end a replica's streaming call when its caller dies: the engine
would go on generating for nobody. Each channel carries its ingress's actor
handle; the replica pings those every few seconds. Only a definite death counts
(the actor is gone); a slow or briefly unreachable ingress is alive.
"""
from __future__ import annotations

import asyncio
from typing import Any


async def _is_dead(handle: Any, timeout_s: float) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError

    try:
        await asyncio.wait_for(handle.__ray_ready__.remote(), timeout_s)
    except ActorUnavailableError:  # restarting or unreachable for now: not dead
        return False
    except RayActorError:
        return True
    except Exception:  # a timeout or anything else: assume alive, ask again later
        return False
    return False


async def find_dead_owners(handles: dict[str, Any], timeout_s: float) -> list[str]:
    """The owners (of `handles`, owner -> actor handle) whose actor is dead."""
    if not handles:
        return []
    owners = list(handles)
    dead = await asyncio.gather(*(_is_dead(handles[o], timeout_s) for o in owners))
    return [owner for owner, is_dead in zip(owners, dead) if is_dead]


# The ingress deployment's name (cluster/api/ingress.py): only its replicas own channels.
INGRESS_DEPLOYMENT = "Ingress"


def ingress_actor_name(owner: str, app_name: str) -> str | None:
    """The Serve actor name of the ingress replica an owner id names
    (`<replica unique id>-<suffix>`, cluster/api/ingress.py), or None if it names none."""
    from cluster.transport.ray_internals import replica_actor_name

    unique_id, sep, suffix = owner.rpartition("-")
    if not sep or not unique_id or not suffix:
        return None
    return replica_actor_name(unique_id, INGRESS_DEPLOYMENT, app_name)


def is_live_ingress_replica(owner: str, owner_handle: Any, app_name: str) -> bool:
    """Whether `owner_handle` is the live ingress replica of this app that `owner`
    names. Blocking (asks the GCS): call it off the event loop.

    NOTE: not an authentication: anyone who can call replicas passed Ray's token auth
    and can run code anywhere in the cluster (RELIABILITY.md). It keeps a stale or
    misrouted channel call, or a caller without the ingress's own actor handle, from
    opening a channel under that ingress's owner id (whose random suffix it would
    also need to know)."""
    import ray

    from cluster.transport.ray_internals import serve_namespace

    name = ingress_actor_name(owner, app_name)
    actor_id = getattr(owner_handle, "_actor_id", None)
    if name is None or actor_id is None:
        return False
    try:
        actor = ray.get_actor(name, namespace=serve_namespace())
    except ValueError:  # no live actor of that name
        return False
    return actor._actor_id == actor_id
