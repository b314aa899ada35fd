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
