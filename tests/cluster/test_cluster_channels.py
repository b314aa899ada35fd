"""The ingress side of the per-step channel, without Ray: a scripted engine handle
answers admission calls and channel calls; `ChannelHub` demultiplexes step
messages and `Relay` turns them into text deltas."""
from __future__ import annotations

import asyncio

import pytest

from cluster.transport.channels import ChannelHub
from cluster.errors import ApiError, ReplicaOverloaded, ReplicaRejected
from cluster.transport.relay import Relay
from cluster.transport.wire import GREETING, EngineRequest, decode_request, encode_step
from deltas.text_stream import TextStream
from deltas.types import FinishReason, TokenDelta
from replicas.config import SamplingParams

_END = object()


class ScriptedCall:
    """A DeploymentResponseGenerator stand-in: yields what the test puts."""

    def __init__(self, *items) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            self.queue.put_nowait(item)
        self.cancelled = False

    def put(self, item) -> None:
        self.queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedEngine:
    """`.generate.remote(...)` admits on `replica_of[request_id]` (default "rep-1")
    unless `refusals` says otherwise; `.channel.remote(...)` opens a channel."""

    def __init__(self) -> None:
        self.replica_of: dict[str, str] = {}
        self.refusals: dict[str, BaseException] = {}
        self.admissions: dict[str, ScriptedCall] = {}
        self.channels: dict[str, list[ScriptedCall]] = {}
        self.generate = _Method(self._generate)
        self.channel = _Method(self._channel)

    def _generate(self, wire: bytes) -> ScriptedCall:
        request = decode_request(wire)
        refusal = self.refusals.get(request.request_id)
        call = ScriptedCall(refusal if refusal else self.replica_of.get(request.request_id, "rep-1"))
        self.admissions[request.request_id] = call
        return call

    def _channel(self, owner, owner_handle=None, pin_replica_id=None) -> ScriptedCall:
        call = ScriptedCall(GREETING)
        self.channels.setdefault(pin_replica_id, []).append(call)
        return call

    def step(self, replica_id: str, *deltas: TokenDelta) -> None:
        self.channels[replica_id][-1].put(encode_step(list(deltas)))


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class RaySideError(Exception):
    """What a dead replica's call raises (Ray wraps the cause)."""


@pytest.fixture(autouse=True)
def no_replica_avoided_after():
    """A lost replica is avoided by this process for a while: not by the next test."""
    from cluster.transport import replica_avoidance

    yield
    replica_avoidance.clear()


@pytest.fixture(scope="module")
def tokenizer():
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.checkpoints.presets import resolve_tokenizer_dir

    return Tokenizer.from_dir(resolve_tokenizer_dir("tiny"))


def _delta(request_id: str, token_ids, n: int, finish: bool = False) -> TokenDelta:
    return TokenDelta(request_id, list(token_ids), num_prompt_tokens=2, num_output_tokens=n,
                      finish_reason=FinishReason.LENGTH if finish else None)


async def _open(engine, hub, tokenizer, request_id: str, stop=None, timeout_s=None) -> Relay:
    request = EngineRequest(request_id, [5, 6], SamplingParams(max_tokens=16), hub.owner)
    return await Relay.open(engine, hub, request, TextStream(tokenizer, stop=stop),
                            timeout_s=timeout_s)


async def _until(predicate, timeout_s=2.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def _opening(engine, hub, tokenizer, request_id, **kwargs) -> asyncio.Task:
    return asyncio.ensure_future(_open(engine, hub, tokenizer, request_id, **kwargs))


async def _open_with_first(engine, hub, tokenizer, request_id, replica="rep-1", **kw) -> Relay:
    engine.replica_of[request_id] = replica
    task = _opening(engine, hub, tokenizer, request_id, **kw)
    await _until(lambda: engine.channels.get(replica))
    await asyncio.sleep(0)
    engine.step(replica, _delta(request_id, [], 0))  # a first (empty) delta
    return await task


def test_one_step_message_reaches_each_request_and_merges_when_behind(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        ids = tokenizer.encode("The quick brown fox jumps", add_special_tokens=False)
        relays = [await _open_with_first(engine, hub, tokenizer, rid) for rid in ("a", "b")]
        assert len(engine.channels["rep-1"]) == 1  # one channel per replica, not per request
        for i, tid in enumerate(ids):  # the consumers are busy: collectors merge
            engine.step("rep-1", _delta("a", [tid], i + 1, finish=i == len(ids) - 1),
                        _delta("b", [tid], i + 1, finish=i == len(ids) - 1))
        await asyncio.sleep(0.05)
        for relay in relays:
            out = [td async for td in relay.text_deltas()]
            assert len(out) == 2  # the empty first delta, then everything at once
            assert "".join(td.text for td in out) == tokenizer.decode(ids)
            assert out[-1].finish_reason == FinishReason.LENGTH
        assert not any(c.cancelled for c in engine.admissions.values())
        assert hub._collectors == {}  # forgotten once done

    asyncio.run(run())


def test_abort_lets_go_of_an_unread_relay_and_does_nothing_to_a_closed_one(tokenizer):
    """What a response that ended before its body started does (SSEResponse's
    on_end): the relay it never read is stopped; one its body closed is left alone."""
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        unread = await _open_with_first(engine, hub, tokenizer, "a")
        done = await _open_with_first(engine, hub, tokenizer, "b")
        engine.step("rep-1", _delta("b", [5], 1, finish=True))
        assert [td.finish_reason async for td in done.text_deltas()][-1] == FinishReason.LENGTH
        for relay in (unread, done, unread):  # twice: the second does nothing
            relay.abort()
        assert engine.admissions["a"].cancelled and not engine.admissions["b"].cancelled
        assert hub._collectors == {}

    asyncio.run(run())


def test_stop_string_cancels_the_admission_call(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        relay = await _open_with_first(engine, hub, tokenizer, "a", stop=["three"])
        ids = tokenizer.encode("one two three four", add_special_tokens=False)
        for i, tid in enumerate(ids):
            engine.step("rep-1", _delta("a", [tid], i + 1))
        out = [td async for td in relay.text_deltas()]
        assert "".join(td.text for td in out) == "one two "
        assert out[-1].finish_reason == FinishReason.STOP
        assert engine.admissions["a"].cancelled  # the replica aborts it

    asyncio.run(run())


def test_a_failed_channel_fails_only_the_requests_of_its_replica(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        dead = await _open_with_first(engine, hub, tokenizer, "a", replica="rep-1")
        alive = await _open_with_first(engine, hub, tokenizer, "b", replica="rep-2")
        engine.channels["rep-1"][-1].put(RaySideError("ActorDiedError: the replica died"))
        out = [td async for td in dead.text_deltas()]
        assert out[-1].finish_reason == FinishReason.ERROR and "unavailable" in out[-1].error
        engine.step("rep-2", _delta("b", [65], 1, finish=True))
        out = [td async for td in alive.text_deltas()]
        assert out[-1].finish_reason == FinishReason.LENGTH

    asyncio.run(run())


def test_refusals_and_early_deaths_are_http_errors_before_any_header(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        engine.refusals["busy"] = ReplicaOverloaded("queue full", 2.0)
        engine.refusals["bad"] = ReplicaRejected("temperature must be >= 0")
        with pytest.raises(ApiError) as info:
            await _open(engine, hub, tokenizer, "busy")
        assert info.value.status == 429 and info.value.retry_after_s == 2.0
        with pytest.raises(ApiError) as info:
            await _open(engine, hub, tokenizer, "bad")
        assert info.value.status == 400 and "temperature" in info.value.message
        # Admitted, then the replica dies before the first token.
        task = _opening(engine, hub, tokenizer, "dies")
        await _until(lambda: "dies" in engine.admissions and engine.channels.get("rep-1"))
        engine.admissions["dies"].put(RaySideError("ActorDiedError"))
        with pytest.raises(ApiError) as info:
            await task
        assert info.value.status == 503
        assert hub._collectors == {}

    asyncio.run(run())


def test_a_channel_closed_for_idleness_is_reopened_while_requests_wait(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        relay = await _open_with_first(engine, hub, tokenizer, "a")
        engine.channels["rep-1"][-1].put(_END)  # the replica closed it
        await _until(lambda: len(engine.channels["rep-1"]) == 2)
        engine.step("rep-1", _delta("a", [65], 1, finish=True))
        out = [td async for td in relay.text_deltas()]
        assert out[-1].finish_reason == FinishReason.LENGTH
        await _until(lambda: hub.num_open_channels == 1)
        engine.channels["rep-1"][-1].put(_END)  # nothing attached now: not reopened
        await _until(lambda: hub.num_open_channels == 0)
        assert len(engine.channels["rep-1"]) == 2

    asyncio.run(run())


def test_consumer_cancel_and_timeout_cancel_the_admission_call(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        relay = await _open_with_first(engine, hub, tokenizer, "a")

        async def consume():
            async for _ in relay.text_deltas():
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.02)
        task.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.admissions["a"].cancelled and "a" not in hub._collectors

        slow = await _open_with_first(engine, hub, tokenizer, "b", timeout_s=0.05)
        out = [td async for td in slow.text_deltas()]
        assert out[-1].finish_reason == FinishReason.ERROR and slow.timed_out
        assert engine.admissions["b"].cancelled

    asyncio.run(run())


# --- a replica lost before a request's first token: tried elsewhere, never mixed ---

def _lost_actor():
    from ray.exceptions import ActorDiedError

    return ActorDiedError()


def test_an_admission_on_a_dead_actor_is_retried_elsewhere_under_a_fresh_id(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        engine.refusals["a"] = _lost_actor()  # routed to a replica that just died
        engine.replica_of["a~1"] = "rep-2"
        task = _opening(engine, hub, tokenizer, "a")
        await _until(lambda: engine.channels.get("rep-2"))
        engine.step("rep-2", _delta("a~1", [65], 1))
        relay = await task
        assert relay.request_id == "a~1" and list(engine.admissions) == ["a", "a~1"]
        engine.step("rep-2", _delta("a~1", [66], 2, finish=True))
        out = [td async for td in relay.text_deltas()]
        assert "".join(td.text for td in out) == tokenizer.decode([65, 66])
        assert hub._collectors == {}

    asyncio.run(run())


def test_a_replica_lost_after_admitting_is_retried_and_its_late_deltas_are_dropped(tokenizer):
    from ray.exceptions import ActorUnavailableError

    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        engine.replica_of["a~1"] = "rep-2"
        task = _opening(engine, hub, tokenizer, "a")
        await _until(lambda: "a" in engine.admissions and engine.channels.get("rep-1"))
        await asyncio.sleep(0.01)
        # rep-1 admitted it, then cannot be reached before the first token
        engine.admissions["a"].put(ActorUnavailableError("unreachable", None))
        await _until(lambda: engine.channels.get("rep-2"))
        # rep-1 still sends for the old id (it was alive after all): never delivered
        engine.step("rep-1", _delta("a", [70], 1), _delta("a", [71], 2, finish=True))
        engine.step("rep-2", _delta("a~1", [65], 1))
        relay = await task
        assert engine.admissions["a"].cancelled  # the old attempt is aborted on rep-1
        engine.step("rep-2", _delta("a~1", [66], 2, finish=True))
        out = [td async for td in relay.text_deltas()]
        assert "".join(td.text for td in out) == tokenizer.decode([65, 66])
        assert out[-1].finish_reason == FinishReason.LENGTH

    asyncio.run(run())


def test_a_channel_lost_before_the_first_token_is_retried_elsewhere(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        engine.replica_of["a~1"] = "rep-2"
        task = _opening(engine, hub, tokenizer, "a")
        await _until(lambda: engine.channels.get("rep-1"))
        await asyncio.sleep(0.01)
        engine.channels["rep-1"][-1].put(_lost_actor())  # the replica's node is gone
        await _until(lambda: engine.channels.get("rep-2"))
        engine.step("rep-2", _delta("a~1", [65], 1, finish=True))
        relay = await task
        assert engine.admissions["a"].cancelled  # the old attempt is aborted on rep-1
        out = [td async for td in relay.text_deltas()]
        assert out[-1].finish_reason == FinishReason.LENGTH and not hub._collectors
        assert not hub._channel_lost

    asyncio.run(run())


def test_errors_of_the_request_itself_are_not_retried_and_retries_are_bounded(tokenizer):
    from cluster.errors import ReplicaUnavailable
    from cluster.transport.relay import MAX_ADMISSION_ATTEMPTS, RETRY_ID_SEP

    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        # the engine fails the request (not the replica): the error is the answer
        task = _opening(engine, hub, tokenizer, "a")
        await _until(lambda: engine.channels.get("rep-1"))
        await asyncio.sleep(0.01)
        error = TokenDelta("a", [], num_prompt_tokens=2, num_output_tokens=0,
                           finish_reason=FinishReason.ERROR, error="step failed")
        engine.step("rep-1", error)
        with pytest.raises(ApiError) as info:
            await task
        assert info.value.status == 500 and list(engine.admissions) == ["a"]
        # the replica itself lost twice: one retry only (a request that took its
        # replica down must not take the next), then 503
        engine.refusals.update({"b": _lost_actor(), "b~1": _lost_actor(), "b~2": _lost_actor()})
        with pytest.raises(ApiError) as info:
            await _open(engine, hub, tokenizer, "b")
        assert info.value.status == 503 and info.value.code == "engine_unavailable"
        assert [r for r in engine.admissions if r.startswith("b")] == ["b", "b~1"]
        # engines found dead refuse cleanly: every attempt, then 503
        dead = ReplicaUnavailable("engine died", replica_id="rep-1")
        engine.refusals.update({f"c{RETRY_ID_SEP}{i}" if i else "c": dead
                                for i in range(MAX_ADMISSION_ATTEMPTS)})
        with pytest.raises(ApiError) as info:
            await _open(engine, hub, tokenizer, "c")
        assert info.value.status == 503
        assert len([r for r in engine.admissions if r.startswith("c")]) == MAX_ADMISSION_ATTEMPTS
        # a channel refused for a reason of its own is not a lost replica: no retry
        task = _opening(engine, hub, tokenizer, "d")
        await _until(lambda: engine.channels.get("rep-1"))
        await asyncio.sleep(0.01)
        engine.channels["rep-1"][-1].put(PermissionError("channel refused"))
        with pytest.raises(ApiError):
            await task
        assert [r for r in engine.admissions if r.startswith("d")] == ["d"]
        assert hub._collectors == {} and not hub._channel_lost

    asyncio.run(run())


# --- a replica lost after the first delta: a stream's 503 event, a JSON answer run again ---

class _TokenCounts:
    def __init__(self) -> None:
        self.counted: list[tuple[int, int]] = []

    def count_tokens(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.counted.append((num_prompt_tokens, num_output_tokens))


def test_a_replica_lost_mid_stream_ends_it_with_a_503_and_is_avoided(tokenizer):
    from cluster.api.response_writer import _engine_failure
    from cluster.transport import replica_avoidance

    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        relay = await _open_with_first(engine, hub, tokenizer, "a")
        engine.step("rep-1", _delta("a", [65], 1))
        await asyncio.sleep(0.01)
        engine.channels["rep-1"][-1].put(_lost_actor())  # the replica's node is gone
        out = [td async for td in relay.text_deltas()]
        assert tokenizer.decode([65]) in "".join(td.text for td in out)
        assert out[-1].finish_reason == FinishReason.ERROR and relay.replica_lost
        error = _engine_failure(out[-1], relay)
        assert (error.status, error.code, error.headers()) == (
            503, "engine_unavailable", {"Retry-After": "1"})
        assert replica_avoidance.is_avoided("rep-1")  # a client's retry goes elsewhere

    asyncio.run(run())


def test_a_json_answer_whose_replica_is_lost_runs_once_more_under_fresh_ids(tokenizer):
    from cluster.api.openai_events import CompletionFormatter
    from cluster.api.response_writer import json_answer

    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        formatter = CompletionFormatter("cmpl-1", "m", 1)
        runs: list[int] = []

        def reopener(request_id: str, replica: str, lost: bool):
            async def reopen(run: int):
                runs.append(run)
                rid = f"{request_id}~r{run}"
                relay = await _open_with_first(engine, hub, tokenizer, rid, replica=replica)
                if lost:
                    engine.channels[replica][-1].put(_lost_actor())
                else:
                    engine.step(replica, _delta(rid, [66], 1, finish=True))
                return [relay]
            return reopen

        async def lost_mid_answer(request_id: str, replica: str):
            relay = await _open_with_first(engine, hub, tokenizer, request_id, replica=replica)
            engine.step(replica, _delta(request_id, [65], 1))
            await asyncio.sleep(0.01)
            engine.channels[replica][-1].put(_lost_actor())
            return [relay]

        # lost once: the answer is the second run's, counted once, nothing of the first
        counts = _TokenCounts()
        relays = await lost_mid_answer("a", "rep-1")
        body = await json_answer(relays, reopener("a", "rep-2", lost=False), formatter,
                                 False, None, 2, metrics=counts)
        assert body["choices"][0]["text"] == tokenizer.decode([66]) and runs == [1]
        assert engine.admissions["a"].cancelled and counts.counted == [(2, 1)]
        # lost twice: one run more only, then the 503 (no tokens out)
        runs.clear()
        counts = _TokenCounts()
        relays = await lost_mid_answer("b", "rep-3")
        with pytest.raises(ApiError) as info:
            await json_answer(relays, reopener("b", "rep-4", lost=True), formatter,
                              False, None, 2, metrics=counts)
        assert (info.value.status, info.value.code) == (503, "engine_unavailable")
        assert runs == [1] and counts.counted == [(2, 0)]
        # the engine failing the request is its answer: a 500, never run again
        runs.clear()
        relay = await _open_with_first(engine, hub, tokenizer, "c", replica="rep-5")
        engine.step("rep-5", TokenDelta("c", [], num_prompt_tokens=2, num_output_tokens=0,
                                        finish_reason=FinishReason.ERROR, error="step failed"))
        with pytest.raises(ApiError) as info:
            await json_answer([relay], reopener("c", "rep-6", lost=False), formatter,
                              False, None, 2)
        assert info.value.status == 500 and runs == []
        assert hub._collectors == {}

    asyncio.run(run())


def test_n_choices_run_again_together_when_one_choice_loses_its_replica(tokenizer):
    from cluster.api.openai_events import CompletionFormatter
    from cluster.api.response_writer import json_answer

    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        relays = [await _open_with_first(engine, hub, tokenizer, "a-0", replica="rep-1"),
                  await _open_with_first(engine, hub, tokenizer, "a-1", replica="rep-2")]
        engine.step("rep-2", _delta("a-1", [65], 1))  # the other choice is under way
        await asyncio.sleep(0.01)
        engine.channels["rep-1"][-1].put(_lost_actor())

        async def reopen(run: int):
            again = [await _open_with_first(engine, hub, tokenizer, f"a~r{run}-{i}",
                                            replica="rep-3") for i in range(2)]
            for i in range(2):
                engine.step("rep-3", _delta(f"a~r{run}-{i}", [66 + i], 1, finish=True))
            return again

        body = await json_answer(relays, reopen, CompletionFormatter("cmpl-a", "m", 1),
                                 False, None, 2)
        assert [c["text"] for c in body["choices"]] == [tokenizer.decode([66]),
                                                         tokenizer.decode([67])]
        assert body["usage"]["completion_tokens"] == 2
        assert engine.admissions["a-1"].cancelled  # the choice still running is aborted
        assert hub._collectors == {}

    asyncio.run(run())


# --- a run again (cluster/api/choice_runs.py): ids, pending bound, one retry, one timeout ---

async def _first_deltas(engine, request_ids, replica="rep-1"):
    """Answer each admission of `request_ids`, in order, with a first (empty) delta."""
    for rid in request_ids:
        await _until(lambda: rid in engine.admissions and engine.channels.get(replica))
        await asyncio.sleep(0.01)
        engine.step(replica, _delta(rid, [], 0))


def _runs(engine, hub, tokenizer, request_id, n=1, gate=None, timeout_s=None):
    from cluster.api.choice_runs import ChoiceRuns
    from cluster.api.pending_gate import PendingGate

    return ChoiceRuns(engine, hub, request_id, [[5, 6]], SamplingParams(max_tokens=16), n,
                      lambda: TextStream(tokenizer), gate or PendingGate(None), timeout_s,
                      None)


def test_a_run_again_has_ids_of_its_own_waits_in_the_pending_bound_and_is_not_retried(
        tokenizer):
    from cluster.api.pending_gate import PendingGate

    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        gate = PendingGate(limit=1)
        runs = _runs(engine, hub, tokenizer, "cmpl-a", n=2, gate=gate)
        first = asyncio.ensure_future(runs.open())
        await _first_deltas(engine, ["cmpl-a-0", "cmpl-a-1"])
        assert [r.request_id for r in await first] == ["cmpl-a-0", "cmpl-a-1"]
        again = asyncio.ensure_future(runs.open_again(1))
        await _until(lambda: "cmpl-a~r1-0" in engine.admissions)
        assert gate.num_pending == 1  # waiting for its first token, it counts
        await _first_deltas(engine, ["cmpl-a~r1-0", "cmpl-a~r1-1"])
        assert [r.request_id for r in await again] == ["cmpl-a~r1-0", "cmpl-a~r1-1"]
        assert gate.num_pending == 0
        for relay in await first + await again:
            relay.abort()
        # a run again whose replica is lost before its first token: no retry, 503
        runs = _runs(engine, hub, tokenizer, "cmpl-b")
        first = asyncio.ensure_future(runs.open())
        await _first_deltas(engine, ["cmpl-b"])
        (await first)[0].abort()
        engine.refusals["cmpl-b~r1"] = _lost_actor()
        with pytest.raises(ApiError) as info:
            await runs.open_again(1)
        assert (info.value.status, info.value.code) == (503, "engine_unavailable")
        assert [r for r in engine.admissions if r.startswith("cmpl-b")] == ["cmpl-b", "cmpl-b~r1"]
        assert hub._collectors == {} and gate.num_pending == 0

    asyncio.run(run())


def test_a_run_again_keeps_the_first_runs_timeout(tokenizer):
    async def run():
        engine = ScriptedEngine()
        hub = ChannelHub(engine, "ing")
        # its first token comes: the answer ends when the first run's timeout does
        runs = _runs(engine, hub, tokenizer, "a", timeout_s=0.4)
        first = asyncio.ensure_future(runs.open())
        await _first_deltas(engine, ["a"])
        (await first)[0].abort()
        again = asyncio.ensure_future(runs.open_again(1))
        await _first_deltas(engine, ["a~r1"])
        relay, = await again
        assert relay._deadline == runs._first_token_at + 0.4  # not 0.4 s from now
        out = [td async for td in relay.text_deltas()]
        assert out[-1].finish_reason == FinishReason.ERROR and relay.timed_out
        # no first token before the timeout: 504, not a 503 for the queue
        runs = _runs(engine, hub, tokenizer, "b", timeout_s=0.3)
        first = asyncio.ensure_future(runs.open())
        await _first_deltas(engine, ["b"])
        (await first)[0].abort()
        with pytest.raises(ApiError) as info:
            await runs.open_again(1)
        assert (info.value.status, info.value.code) == (504, "timeout")
        assert engine.admissions["b~r1"].cancelled
        # the timeout already past: 504 without admitting it anywhere
        with pytest.raises(ApiError) as info:
            await runs.open_again(2)
        assert info.value.status == 504 and "b~r2" not in engine.admissions
        assert hub._collectors == {}

    asyncio.run(run())
