"""The channel-owner liveness backstop (`cluster/transport/owner_liveness.find_dead_owners`,
which the engine replica's sweeper uses to abort the requests of a dead ingress)
against real Ray actors: an actor that is killed is reported dead within a bounded
wait, and a live actor, even one too busy to answer a ping in time, never is.
(What the replica does with a dead owner is tested in test_cluster_outbox.py.)"""
from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from cluster.transport.owner_liveness import find_dead_owners
from cluster_support import init_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.own_ray, pytest.mark.timeout(180)]

PING_TIMEOUT_S = 0.5
MAX_WAIT_FOR_DEATH_S = 20.0


class Owner:
    """Stands in for an ingress replica: all the backstop does is ping it."""

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def owner_cls():
    """A local Ray of its own for this module, shut down afterwards; the Owner actor class."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NOTE: address="local" starts a new instance: never one `ray start` left running
    init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False,
                   configure_logging=False)
    try:
        # tests/ is not an installed package: ship the class by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        # num_cpus=0: several actors fit on the one CPU
        yield ray.remote(num_cpus=0)(Owner)
    finally:
        ray.shutdown()


def _start(owner_cls, count: int) -> list:
    import ray

    handles = [owner_cls.remote() for _ in range(count)]
    ray.get([h.__ray_ready__.remote() for h in handles], timeout=60)
    return handles


def test_a_killed_actor_is_reported_dead_and_a_live_one_never(owner_cls):
    import ray

    alive, doomed = _start(owner_cls, 2)
    handles = {"ing-alive": alive, "ing-doomed": doomed}

    async def run():
        assert await find_dead_owners(handles, PING_TIMEOUT_S) == []
        ray.kill(doomed, no_restart=True)
        deadline = time.monotonic() + MAX_WAIT_FOR_DEATH_S
        while True:
            dead = await find_dead_owners(handles, PING_TIMEOUT_S)
            assert "ing-alive" not in dead
            if dead == ["ing-doomed"]:
                break
            assert time.monotonic() < deadline, \
                f"a killed actor not reported dead within {MAX_WAIT_FOR_DEATH_S:g} s"
            await asyncio.sleep(0.1)
        # dead stays dead; the live one still answers
        assert await find_dead_owners(handles, PING_TIMEOUT_S) == ["ing-doomed"]
        assert await find_dead_owners({"ing-alive": alive}, PING_TIMEOUT_S) == []

    asyncio.run(run())
    ray.kill(alive)


def test_a_live_actor_too_busy_to_answer_in_time_is_not_dead(owner_cls):
    import ray

    busy, = _start(owner_cls, 1)
    busy.busy.remote(60.0)  # the ping queues behind it

    async def run():
        started = time.monotonic()
        assert await find_dead_owners({"ing-busy": busy}, PING_TIMEOUT_S) == []
        # the ping timed out (it was not answered): the control that it was busy
        assert time.monotonic() - started >= PING_TIMEOUT_S

    asyncio.run(run())
    ray.kill(busy)
