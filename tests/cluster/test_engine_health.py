"""/health from every engine replica, without Ray (cluster/api/engine_health.py): a fake
engine handle routes an unpinned call to a random replica, as Serve's does, so a check
that asked "the engine" once would flip between healthy and not."""
from __future__ import annotations

import asyncio
import json
import random
import time

from cluster.api.engine_health import EngineHealthCheck
from cluster.api.ingress import _HealthCache


class _Response:
    def __init__(self, answer) -> None:
        self._answer = answer
        self.cancelled = False

    def __await__(self):
        return self._answer().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _Engine:
    """Replicas by id: "ok", "fail" (the check raises) or "hang" (never answers)."""

    def __init__(self, replicas: dict[str, str], delay_s: float = 0.01) -> None:
        self.replicas = replicas
        self.delay_s = delay_s
        self.asked: list[str] = []
        self.responses: list[_Response] = []
        self.health = self

    def remote(self, pin_replica_id: str | None = None) -> _Response:
        replica_id = pin_replica_id or random.choice(list(self.replicas))
        self.asked.append(replica_id)

        async def answer():
            await asyncio.sleep(self.delay_s)
            if self.replicas[replica_id] == "hang":
                await asyncio.Event().wait()
            if self.replicas[replica_id] == "fail":
                raise RuntimeError("engine dead")
            return True
        self.responses.append(_Response(answer))
        return self.responses[-1]


def _running(engine: _Engine):
    async def list_replicas():
        return {rid: "RUNNING" for rid in engine.replicas}
    return list_replicas


def _answers(engine: _Engine, num_hits: int, **check_kwargs) -> list[tuple[int, dict]]:
    check = EngineHealthCheck(engine, list_replicas=_running(engine), **check_kwargs)
    cache = _HealthCache(ttl_s=0.0, check=check.run)  # NOTE: 0: every hit checks anew

    async def main():
        answers = []
        for _ in range(num_hits):
            response = (await cache.health()).response()
            answers.append((response.status_code, json.loads(response.body)))
        return answers
    return asyncio.run(main())


def test_one_unhealthy_replica_of_two_keeps_health_200_and_names_it():
    engine = _Engine({"replica-a": "ok", "replica-b": "fail"})
    answers = _answers(engine, num_hits=10)
    assert [status for status, _ in answers] == [200] * 10
    for _, body in answers:
        assert body == {"status": "ok", "num_healthy_replicas": 1, "num_replicas": 2,
                        "unhealthy_replicas": {"replica-b": "RuntimeError"}}
    assert engine.asked.count("replica-a") == engine.asked.count("replica-b") == 10


def test_no_healthy_replica_is_503_naming_each():
    engine = _Engine({"replica-a": "fail", "replica-b": "fail"})
    for status, body in _answers(engine, num_hits=3):
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        assert body["num_healthy_replicas"] == 0 and body["num_replicas"] == 2
        assert body["unhealthy_replicas"] == {"replica-a": "RuntimeError",
                                              "replica-b": "RuntimeError"}
        assert "replica-a: RuntimeError" in body["error"]["message"]


def test_replicas_are_asked_at_once_and_a_hung_one_only_for_the_timeout():
    engine = _Engine({"replica-a": "ok", "replica-b": "hang", "replica-c": "ok"}, delay_s=0.2)
    start = time.monotonic()
    (status, body), = _answers(engine, num_hits=1, timeout_s=0.5)
    assert time.monotonic() - start < 1.0  # 0.5 s at most, not 0.2 + 0.5 + 0.2
    assert status == 200 and body["unhealthy_replicas"] == {"replica-b": "TimeoutError"}
    hung, = [r for rid, r in zip(engine.asked, engine.responses) if rid == "replica-b"]
    assert hung.cancelled  # the pinned call does not wait on in the router


def test_replicas_serve_routes_nothing_to_are_not_asked():
    engine = _Engine({"replica-a": "ok", "replica-b": "ok", "replica-c": "ok"})

    async def list_replicas():
        return {"replica-a": "RUNNING", "replica-b": "STARTING", "replica-c": "STOPPING"}

    health = asyncio.run(EngineHealthCheck(engine, list_replicas=list_replicas).run())
    assert engine.asked == ["replica-a"]
    assert health.as_dict() == {"status": "ok", "num_healthy_replicas": 1, "num_replicas": 3,
                                "unhealthy_replicas": {"replica-b": "STARTING",
                                                       "replica-c": "STOPPING"}}


def test_no_replica_known_is_503_and_a_controller_away_keeps_the_last_list():
    engine = _Engine({"replica-a": "ok"})
    listing = {"fails": True}

    async def list_replicas():
        if listing["fails"]:
            raise ConnectionError("controller away")
        return {"replica-a": "RUNNING"}

    check = EngineHealthCheck(engine, list_replicas=list_replicas)

    async def main():
        first = await check.run()
        listing["fails"] = False
        second = await check.run()
        listing["fails"] = True
        return first, second, await check.run()
    first, second, third = asyncio.run(main())
    assert first.response().status_code == 503
    assert json.loads(first.response().body)["error"]["message"] == (
        "engine unhealthy: no healthy engine replica (no engine replica known (ConnectionError))")
    assert second.is_healthy and third.is_healthy and engine.asked == ["replica-a"] * 2


def test_an_empty_deployment_is_503():
    async def list_replicas():
        return {}

    health = asyncio.run(EngineHealthCheck(_Engine({}), list_replicas=list_replicas).run())
    assert health.response().status_code == 503 and health.error == "no engine replica known"
