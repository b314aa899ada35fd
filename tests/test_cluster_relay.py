"""The replica's chunking and the ingress relay, without Ray: a scripted engine
feeds EngineReplica.generate; a scripted handle stream feeds Relay."""
from __future__ import annotations

import asyncio

import pytest

from cluster.errors import ReplicaOverloaded, ReplicaRejected
from cluster.relay import Relay
from cluster.replica import EngineReplica
from deltas.collector import DeltaCollector
from deltas.types import FinishReason, TokenDelta

REPLICA_CLS = EngineReplica.func_or_class


class ScriptedEngine:
    """The AsyncEngine contract, with tokens emitted by the test."""

    def __init__(self, config) -> None:
        self.collectors: dict[str, DeltaCollector] = {}
        self.aborted: list[str] = []
        self.num_out: dict[str, int] = {}

    async def generate(self, request_id, prompt_token_ids, params):
        from replicas.async_engine import EngineOverloaded

        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if prompt_token_ids == [666]:
            raise EngineOverloaded("queue full", 3.0)
        collector = self.collectors[request_id] = DeltaCollector(request_id)
        self.num_out[request_id] = 0
        while True:
            delta = await collector.get()
            yield delta
            if delta.finished:
                return

    def emit(self, request_id: str, *token_ids: int, finish: bool = False) -> None:
        for i, tid in enumerate(token_ids):
            self.num_out[request_id] += 1
            last = finish and i == len(token_ids) - 1
            self.collectors[request_id].put(TokenDelta(
                request_id, [tid], finish_reason=FinishReason.LENGTH if last else None,
                num_prompt_tokens=2, num_output_tokens=self.num_out[request_id]))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {"num_running": 0}

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _replica(**kwargs):
    replica = REPLICA_CLS({"model": "tiny"}, engine_factory=ScriptedEngine, **kwargs)
    return replica, replica._engine


def _request(request_id="r1", prompt=(5, 6), **extra) -> dict:
    return {"request_id": request_id, "prompt_token_ids": list(prompt),
            "sampling_params": {"max_tokens": 100}, **extra}


async def _until(predicate, timeout_s=2.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def _decode(item, request_id="r1") -> TokenDelta:
    from cluster.wire import decode_delta

    return decode_delta(request_id, item)


def test_first_token_at_once_then_whatever_accumulated_in_one_chunk():
    async def run():
        replica, engine = _replica()
        stream = replica.generate(_request())
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: "r1" in engine.collectors)
        engine.emit("r1", 10)
        assert _decode(await first).token_ids == [10]
        engine.emit("r1", 11, 12)  # the consumer (Serve) is busy: the collector merges
        engine.emit("r1", 13)
        chunk2 = _decode(await stream.__anext__())
        assert chunk2.token_ids == [11, 12, 13] and chunk2.num_output_tokens == 4
        engine.emit("r1", 14, finish=True)
        chunk3 = _decode(await stream.__anext__())
        assert chunk3.finish_reason == FinishReason.LENGTH and chunk3.token_ids == [14]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        stats = replica.stats()
        assert engine.aborted == [] and stats["num_streams_finished"] == 1
        assert (stats["num_chunks_sent"], stats["num_tokens_sent"]) == (3, 5)

    asyncio.run(run())


def test_no_merge_mode_sends_one_chunk_per_token():
    async def run():
        replica, engine = _replica(stream_merge=False)
        stream = replica.generate(_request())
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: "r1" in engine.collectors)
        engine.emit("r1", 1, 2, 3, finish=True)
        chunks = [_decode(await first)] + [_decode(c) async for c in stream]
        assert [c.token_ids for c in chunks] == [[1], [2], [3]]
        assert [c.num_output_tokens for c in chunks] == [1, 2, 3]
        assert chunks[-1].finish_reason == FinishReason.LENGTH

    asyncio.run(run())


def test_min_chunk_interval_spaces_chunks():
    async def run():
        replica, engine = _replica(min_chunk_interval_ms=150)
        stream = replica.generate(_request())
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: "r1" in engine.collectors)
        engine.emit("r1", 1)
        await first
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        engine.emit("r1", 2)
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not nxt.done()
        engine.emit("r1", 3)
        chunk2 = _decode(await nxt)
        assert loop.time() - sent_at >= 0.14
        assert chunk2.token_ids == [2, 3]
        await stream.aclose()

    asyncio.run(run())


def test_chunk_budget_is_shared_by_the_active_streams():
    async def run():
        replica, engine = _replica(max_chunks_per_s=20)  # 2 streams: 100 ms apart each
        streams = [replica.generate(_request(rid)) for rid in ("a", "b")]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await _until(lambda: len(engine.collectors) == 2)
        for rid in ("a", "b"):
            engine.emit(rid, 1)
        for f in firsts:
            await f
        loop = asyncio.get_running_loop()
        start = loop.time()
        nxt = asyncio.ensure_future(streams[0].__anext__())
        engine.emit("a", 2)
        await asyncio.sleep(0.05)
        assert not nxt.done()
        engine.emit("a", 3)
        chunk = _decode(await nxt, "a")
        assert loop.time() - start >= 0.09 and chunk.token_ids == [2, 3]
        for s in streams:
            await s.aclose()
        assert replica._num_active_streams == 0

    asyncio.run(run())


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancelled_stream_aborts_the_engine_request(how):
    async def run():
        replica, engine = _replica()
        stream = replica.generate(_request())
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: "r1" in engine.collectors)
        engine.emit("r1", 1)
        await first
        if how == "aclose":
            await stream.aclose()
        else:  # Serve cancels the task that iterates the generator
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert engine.aborted == ["r1"]
        assert replica.stats()["num_streams_cancelled"] == 1

    asyncio.run(run())


def test_engine_refusals_become_replica_errors_before_the_first_chunk():
    async def run():
        replica, _ = _replica()
        with pytest.raises(ReplicaRejected, match="empty"):
            await replica.generate(_request(prompt=())).__anext__()
        with pytest.raises(ReplicaOverloaded) as info:
            await replica.generate(_request(prompt=(666,))).__anext__()
        assert info.value.retry_after_s == 3.0
        with pytest.raises(ReplicaRejected, match="temperature"):
            await replica.generate({**_request(), "sampling_params": {"temperature": -1}}) \
                .__anext__()

    asyncio.run(run())


class ScriptedHandleStream:
    """A DeploymentResponseGenerator stand-in fed by the test."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from cluster.wire import encode_delta

        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return encode_delta(item)  # what a replica streams

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture(scope="module")
def tokenizer():
    from deltas.tokenizer import Tokenizer
    from replicas.presets import resolve_tokenizer_dir

    return Tokenizer.from_dir(resolve_tokenizer_dir("tiny"))


def _deltas(tokenizer, text: str):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, [TokenDelta("r", [t], num_prompt_tokens=1, num_output_tokens=i + 1)
                 for i, t in enumerate(ids)]


def test_relay_merges_pending_deltas_when_the_consumer_is_behind(tokenizer):
    from deltas.text_stream import TextStream

    async def run():
        ids, deltas = _deltas(tokenizer, "The quick brown fox jumps over the lazy dog")
        gen = ScriptedHandleStream()
        aborted = []
        relay = Relay("r", gen, deltas[0], TextStream(tokenizer), aborted.append)
        texts = relay.text_deltas()
        first = await texts.__anext__()
        for d in deltas[1:]:
            gen.queue.put_nowait(d)
        gen.queue.put_nowait(TokenDelta("r", [], finish_reason=FinishReason.LENGTH,
                                        num_output_tokens=len(ids)))
        await asyncio.sleep(0.05)  # the consumer is busy; the pump keeps merging
        rest = [td async for td in texts]
        assert len(rest) == 1  # everything pending came as one text delta
        assert first.text + rest[0].text == tokenizer.decode(ids)
        assert rest[0].finish_reason == FinishReason.LENGTH and not aborted and not gen.cancelled

    asyncio.run(run())


def test_relay_stop_string_cancels_the_stream_and_aborts_on_the_replica(tokenizer):
    from deltas.text_stream import TextStream

    async def run():
        ids, deltas = _deltas(tokenizer, "one two three four five six")
        gen = ScriptedHandleStream()
        aborted = []
        relay = Relay("r", gen, deltas[0], TextStream(tokenizer, stop=["three"]), aborted.append)
        for d in deltas[1:]:
            gen.queue.put_nowait(d)
        out = [td async for td in relay.text_deltas()]
        assert "".join(td.text for td in out) == "one two "
        assert out[-1].finish_reason == FinishReason.STOP and out[-1].stop_reason == "three"
        assert gen.cancelled and aborted == ["r"]

    asyncio.run(run())


def test_relay_turns_a_dead_replica_into_an_error_delta(tokenizer):
    from deltas.text_stream import TextStream

    async def run():
        _, deltas = _deltas(tokenizer, "hello world")
        gen = ScriptedHandleStream()
        relay = Relay("r", gen, deltas[0], TextStream(tokenizer), lambda rid: None)
        gen.queue.put_nowait(RuntimeError("ActorDiedError: the replica died"))
        out = [td async for td in relay.text_deltas()]
        assert out[-1].finish_reason == FinishReason.ERROR and out[-1].error

    asyncio.run(run())


def test_relay_consumer_cancel_stops_the_replica(tokenizer):
    from deltas.text_stream import TextStream

    async def run():
        _, deltas = _deltas(tokenizer, "hello world")
        gen = ScriptedHandleStream()
        aborted = []
        relay = Relay("r", gen, deltas[0], TextStream(tokenizer), aborted.append)

        async def consume():
            async for _ in relay.text_deltas():
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.02)
        task.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gen.cancelled and aborted == ["r"]

    asyncio.run(run())
