"""The replica side of the per-step channel, without Ray: a scripted engine feeds
EngineReplica's admission calls (`generate`) and per-ingress channels (`channel`)."""
from __future__ import annotations

import asyncio

import dataclasses

import msgspec
import pytest

from cluster.errors import ReplicaOverloaded, ReplicaRejected
from cluster.transport.replica import EngineReplica
from cluster.transport.wire import GREETING, EngineRequest, decode_step, encode_request
from deltas.collector import WakeBatch
from deltas.types import FinishReason, TokenDelta
from replicas.config import SamplingParams
from replicas.engine_stats import EngineStats

REPLICA_CLS = EngineReplica.func_or_class


class ScriptedEngine:
    """The AsyncEngine contract the replica uses, with tokens emitted by the test
    the way the output processor emits them: one put per request, one wake per step."""

    def __init__(self, config) -> None:
        self.sinks: dict = {}
        self.num_out: dict[str, int] = {}
        self.aborted: list[str] = []
        self.released: list[str] = []

    async def compile_grammar(self, params):
        return None

    def submit(self, request_id, prompt_token_ids, params, sink, grammar=None) -> None:
        from replicas.async_engine import EngineOverloaded

        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if prompt_token_ids == [666]:
            raise EngineOverloaded("queue full", 3.0)
        self.sinks[request_id] = sink
        self.num_out[request_id] = 0

    def step(self, tokens: dict[str, int], finished: tuple[str, ...] = ()) -> None:
        wakes = WakeBatch()
        for request_id, token in tokens.items():
            self.num_out[request_id] += 1
            self.sinks[request_id].put(TokenDelta(
                request_id, [token], num_prompt_tokens=2,
                num_output_tokens=self.num_out[request_id],
                finish_reason=FinishReason.LENGTH if request_id in finished else None),
                True, wakes)
        wakes.flush()

    def release(self, request_id) -> None:
        self.released.append(request_id)

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class DeadActor:
    """An owner handle whose actor is gone."""

    class _Method:
        def remote(self):
            from ray.exceptions import ActorDiedError

            async def fail():
                raise ActorDiedError()
            return fail()

    __ray_ready__ = _Method()


def _replica(**kwargs):
    kwargs.setdefault("channel_idle_close_s", 0.2)
    replica = REPLICA_CLS({"model": "tiny"}, engine_factory=ScriptedEngine, **kwargs)
    return replica, replica._engine


def _request(request_id="r1", prompt=(5, 6), owner="ing-a", **params) -> bytes:
    return encode_request(EngineRequest(request_id, list(prompt),
                                        SamplingParams(max_tokens=100, **params), owner))


def _unchecked_request(request_id="r1", prompt=(5, 6), owner="ing-a", **params) -> bytes:
    """An `EngineRequest`'s wire shape with sampling values that bypassed SamplingParams
    (a caller other than the ingress)."""
    return msgspec.msgpack.encode([request_id, list(prompt), {"max_tokens": 100, **params},
                                   owner])


async def _admit(replica, request_id="r1", owner="ing-a"):
    """NOTE: keep the returned call: a collected generator is closed, which cancels
    the request, as Serve does when its caller leaves."""
    call = replica.generate(_request(request_id, owner=owner))
    assert await call.__anext__() == "local"  # the replica's id: attach to its channel
    return call


async def _next_message(channel, timeout_s=2.0) -> dict[str, TokenDelta]:
    message = await asyncio.wait_for(channel.__anext__(), timeout_s)
    return {delta.request_id: delta for delta in decode_step(message)}


def test_one_message_per_step_carries_every_request_of_the_ingress():
    async def run():
        replica, engine = _replica()
        calls = [await _admit(replica, rid) for rid in ("a", "b")]
        channel = replica.channel("ing-a")
        assert await channel.__anext__() == GREETING
        engine.step({"a": 10, "b": 20})
        step1 = await _next_message(channel)
        assert {rid: d.token_ids for rid, d in step1.items()} == {"a": [10], "b": [20]}
        engine.step({"a": 11, "b": 21}, finished=("a", "b"))
        step2 = await _next_message(channel)
        assert all(d.finish_reason == FinishReason.LENGTH for d in step2.values())
        for call in calls:  # the admission calls end once the finish was sent
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(call.__anext__(), 1.0)
        stats = replica.stats()
        assert (stats["num_step_messages_sent"], stats["num_deltas_sent"]) == (2, 4)
        assert stats["num_requests_finished"] == 2 and engine.aborted == []
        await channel.aclose()

    asyncio.run(run())


def test_deltas_wait_for_the_channel_and_merge_while_it_is_behind():
    async def run():
        replica, engine = _replica()
        call = await _admit(replica, "a")  # noqa: F841 (kept open)
        engine.step({"a": 1})  # no channel yet: the outbox keeps it
        engine.step({"a": 2})
        channel = replica.channel("ing-a")
        await channel.__anext__()
        merged = await _next_message(channel)
        assert merged["a"].token_ids == [1, 2] and merged["a"].num_output_tokens == 2
        await channel.aclose()

    asyncio.run(run())


def test_each_ingress_gets_its_own_messages():
    async def run():
        replica, engine = _replica()
        calls = [await _admit(replica, "a", owner="ing-a"),  # noqa: F841 (kept open)
                 await _admit(replica, "b", owner="ing-b")]
        chan_a, chan_b = replica.channel("ing-a"), replica.channel("ing-b")
        await chan_a.__anext__()
        await chan_b.__anext__()
        engine.step({"a": 1, "b": 2})
        assert list(await _next_message(chan_a)) == ["a"]
        assert list(await _next_message(chan_b)) == ["b"]
        await chan_a.aclose()
        await chan_b.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancelled_admission_call_aborts_the_request(how):
    async def run():
        replica, engine = _replica()
        call = await _admit(replica)
        if how == "aclose":
            await call.aclose()
        else:  # Serve cancels the task that iterates the generator
            task = asyncio.ensure_future(call.__anext__())
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert engine.aborted == ["r1"] and engine.released == ["r1"]
        assert replica.stats()["num_requests_cancelled"] == 1

    asyncio.run(run())


def test_engine_refusals_raise_before_anything_is_streamed():
    async def run():
        replica, _ = _replica()
        with pytest.raises(ReplicaRejected, match="empty"):
            await replica.generate(_request(prompt=())).__anext__()
        with pytest.raises(ReplicaOverloaded) as info:
            await replica.generate(_request(prompt=(666,))).__anext__()
        assert info.value.retry_after_s == 3.0
        with pytest.raises(ReplicaRejected, match="temperature"):
            await replica.generate(_unchecked_request(temperature=-1)).__anext__()
        stats = replica.stats()
        assert stats["num_requests_refused"] == 3 and stats["num_requests_admitted"] == 0

    asyncio.run(run())


def test_idle_channel_closes_and_a_newer_channel_replaces_an_older_one():
    async def run():
        replica, engine = _replica(channel_idle_close_s=0.1)
        idle = replica.channel("ing-a")
        await idle.__anext__()
        with pytest.raises(StopAsyncIteration):  # no requests: it closes by itself
            await asyncio.wait_for(idle.__anext__(), 1.0)
        call = await _admit(replica, "a")  # noqa: F841 (kept open)
        old, new = replica.channel("ing-a"), replica.channel("ing-a")
        await old.__anext__()
        await new.__anext__()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(old.__anext__(), 1.0)
        engine.step({"a": 7})
        assert (await _next_message(new))["a"].token_ids == [7]
        await new.aclose()

    asyncio.run(run())


def test_requests_of_an_ingress_without_a_channel_are_aborted():
    async def run():
        replica, engine = _replica(ingress_detach_timeout_s=0.2, owner_check_interval_s=0.05)
        call = await _admit(replica, "a")  # admitted, but no channel ever opens
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(call.__anext__(), 2.0)
        assert engine.aborted == ["a"]
        stats = replica.stats()
        # orphaned, and only that: neither finished nor cancelled as well
        assert stats["num_requests_orphaned"] == 1
        assert stats["num_requests_finished"] == stats["num_requests_cancelled"] == 0

    asyncio.run(run())


def test_requests_of_a_dead_ingress_are_aborted_and_its_channel_ends():
    async def run():
        replica, engine = _replica(owner_check_interval_s=0.05)
        call = await _admit(replica, "a")
        channel = replica.channel("ing-a", owner_handle=DeadActor())
        await channel.__anext__()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(call.__anext__(), 2.0)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(channel.__anext__(), 2.0)
        assert engine.aborted == ["a"] and replica.stats()["num_outboxes"] == 0
        stats = replica.stats()
        assert stats["num_requests_orphaned"] == 1
        assert stats["num_requests_finished"] == stats["num_requests_cancelled"] == 0

    asyncio.run(run())


def test_a_request_admitted_to_a_long_idle_outbox_gets_a_full_window():
    async def run():
        # NOTE: a window far longer than the wait below (a slow machine's pauses), far
        # shorter than the detachment: counted from it, the first sweep orphans it.
        replica, engine = _replica(ingress_detach_timeout_s=2.0, owner_check_interval_s=0.05)
        outbox = replica._outboxes.get("ing-a")
        outbox.detached_since -= 10.0  # idle and detached for long
        call = await _admit(replica, "a")
        await asyncio.sleep(0.15)  # within the window, counted from the admission
        channel = replica.channel("ing-a")
        await channel.__anext__()
        await asyncio.sleep(0.5)
        assert engine.aborted == [] and replica.stats()["num_requests_orphaned"] == 0
        await channel.aclose()
        await call.aclose()

    asyncio.run(run())
