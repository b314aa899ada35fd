"""AsyncEngine: streams equal the offline engine, aborts free blocks, slow
consumers get merged deltas and lose nothing."""
import asyncio
import random
import threading
import time

import pytest

from deltas.collector import DeltaCollector
from deltas.types import FinishReason, OutputKind
from replicas import Engine, EngineConfig, SamplingParams
from replicas.async_engine import AsyncEngine, EngineDeadError, EngineOverloaded

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _prompts(n, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference():
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=1, async_output=False)) as e:
        return [o.token_ids for o in e.generate(_prompts(150), GREEDY)]


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineConfig(model="tiny", num_scheduler_steps=8))
    yield eng
    eng.shutdown()


async def _collect(engine, rid, prompt, params=GREEDY, delay=0.0):
    ids, n_deltas, last = [], 0, None
    async for delta in engine.generate(rid, prompt, params):
        ids += delta.token_ids
        n_deltas += 1
        last = delta
        if delay:
            await asyncio.sleep(delay)
    return ids, n_deltas, last


def _assert_idle(engine):
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.num_free_blocks == s.num_total_blocks


def test_streams_equal_offline_outputs(engine, reference):
    async def main():
        return await asyncio.gather(*[_collect(engine, f"s{i}", p)
                                      for i, p in enumerate(_prompts(150)[:32])])
    results = asyncio.run(main())
    for (ids, _, last), ref in zip(results, reference):
        assert ids == ref
        assert last.finish_reason == FinishReason.LENGTH and last.num_output_tokens == len(ref)


@pytest.mark.parametrize("kind", list(OutputKind))
def test_output_kinds(engine, reference, kind):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, output_kind=kind)

    async def main():
        outs = []
        async for d in engine.generate(f"k{kind}", _prompts(150)[0], params):
            outs.append(list(d.token_ids))
        return outs
    outs = asyncio.run(main())
    if kind == OutputKind.DELTA:
        assert sum(outs, []) == reference[0]
    elif kind == OutputKind.CUMULATIVE:
        assert outs[-1] == reference[0]
        assert all(reference[0][:len(o)] == o for o in outs)
    else:
        assert outs == [reference[0]]


def test_slow_consumer_gets_merged_deltas_and_loses_nothing(engine, reference):
    async def main():
        return await _collect(engine, "slow", _prompts(150)[1], delay=0.05)
    ids, n_deltas, _ = asyncio.run(main())
    assert ids == reference[1]
    assert n_deltas < len(ids)  # merged while the consumer slept


def test_aborting_100_streams_frees_every_block(engine, reference):
    rng = random.Random(11)
    prompts = _prompts(150)

    async def main():
        async def run(i):
            cut = rng.randrange(1, 40) if i % 2 == 0 else None
            ids = []
            agen = engine.generate(f"a{i}", prompts[i], GREEDY)
            async for d in agen:
                ids += d.token_ids
                if cut is not None and len(ids) >= cut:
                    await agen.aclose()
                    return i, ids, True
            return i, ids, False

        async def cancelled(i):
            task = asyncio.ensure_future(run(i))
            await asyncio.sleep(rng.random() * 0.3)
            task.cancel()
            return i, None, True

        # 150 streams: 50 closed at a random token, 50 cancelled at a random time, 50 whole
        jobs = [run(i) if i < 100 else cancelled(i) for i in range(150)]
        return await asyncio.gather(*jobs, return_exceptions=True)
    results = asyncio.run(main())
    for res in results:
        if isinstance(res, BaseException):
            continue
        i, ids, aborted = res
        if ids is not None:
            ref = reference[i]
            assert ids == ref[:len(ids)]
            if not aborted:
                assert ids == ref

    async def settle():
        for _ in range(100):
            s = engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
                return
            await asyncio.sleep(0.05)
    asyncio.run(settle())
    _assert_idle(engine)


def test_bad_input_raises_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError):
            async for _ in engine.generate("bad", [], GREEDY):
                pass
        with pytest.raises(ValueError):
            async for _ in engine.generate("bad2", [1, 10**7], GREEDY):
                pass
        ids, _, _ = await _collect(engine, "ok", [5, 6, 7])
        return ids
    assert len(asyncio.run(main())) == 48


def test_overload_and_engine_failure():
    eng = AsyncEngine(EngineConfig(model="tiny", max_waiting_requests=2, max_num_seqs=2),
                      stall_timeout_s=0.5)
    try:
        async def burst():
            results = await asyncio.gather(*[_collect(eng, f"o{i}", [5, 6, 7])
                                             for i in range(12)], return_exceptions=True)
            return results
        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, EngineOverloaded)]
        done = [r for r in results if not isinstance(r, BaseException)]
        assert refused and done and len(refused) + len(done) == 12
        assert all(len(r[0]) == 48 for r in done)
        assert refused[0].retry_after_s > 0

        def boom():
            raise RuntimeError("injected")
        eng.fault_hook = boom

        async def failing():
            return await _collect(eng, "f", [5, 6, 7])
        ids, _, last = asyncio.run(failing())
        assert last.finish_reason == FinishReason.ERROR and "injected" in last.error
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown()


def _hold_command_queue(eng) -> threading.Event:
    """Keep the engine thread from taking queued commands until the event is set:
    a burst arriving faster than the engine thread drains its queue."""
    gate, is_held, drain = threading.Event(), threading.Event(), eng._drain_commands

    def gated_drain():
        is_held.set()
        gate.wait(60)
        drain()
    eng._drain_commands = gated_drain
    eng._wakeup.set()
    assert is_held.wait(10)  # the engine thread waits at the gate, the queue empty
    return gate


def _wait_idle(eng) -> None:
    """Until the released requests' aborts have run, then assert nothing is left."""
    for _ in range(200):
        s = eng.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            break
        time.sleep(0.05)
    _assert_idle(eng)


async def _finish(collector) -> tuple[list[int], FinishReason]:
    ids = []
    async for delta in collector:
        ids += delta.token_ids
    return ids, delta.finish_reason


def test_prompt_token_bound_counts_requests_still_queued():
    max_tokens = 100
    eng = AsyncEngine(EngineConfig(model="tiny", max_waiting_prompt_tokens=max_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        async def burst():
            gate = _hold_command_queue(eng)
            admitted, refused = {}, []
            for i in range(40):
                prompt = [5 + i] * 30
                collector = DeltaCollector(f"b{i}")
                try:
                    eng.submit(f"b{i}", prompt, params, collector)
                    admitted[f"b{i}"] = (len(prompt), collector)
                except EngineOverloaded as e:
                    refused.append(e)
            gate.set()
            results = [await _finish(c) for _, c in admitted.values()]
            for rid in admitted:
                eng.release(rid)
            # alone, a prompt above the bound still runs (or it never would)
            big = DeltaCollector("big")
            eng.submit("big", [5] * (max_tokens + 50), params, big)
            results.append(await _finish(big))
            eng.release("big")
            return admitted, refused, results
        admitted, refused, results = asyncio.run(burst())
        assert sum(n for n, _ in admitted.values()) <= max_tokens
        assert len(admitted) == 3 and len(refused) == 37
        assert all(e.retry_after_s > 0 and "prompt tokens" in str(e) for e in refused)
        assert all(len(ids) == 4 and reason == FinishReason.LENGTH for ids, reason in results)
        _wait_idle(eng)
    finally:
        eng.shutdown()


def test_an_abort_storm_under_the_bounds_is_never_refused():
    eng = AsyncEngine(EngineConfig(model="tiny", max_waiting_requests=4,
                                   max_waiting_prompt_tokens=64))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        async def storm():
            gate = _hold_command_queue(eng)
            kept = {f"k{i}": DeltaCollector(f"k{i}") for i in range(2)}
            for rid, collector in kept.items():
                eng.submit(rid, [7] * 16, params, collector)
            aborted = {}
            for i in range(300):  # 2 kept + 1 live at a time: under both bounds
                aborted[f"a{i}"] = collector = DeltaCollector(f"a{i}")
                eng.submit(f"a{i}", [9] * 16, params, collector)
                eng.abort(f"a{i}")
            gate.set()
            ends = [await _finish(c) for c in aborted.values()]
            kept_results = [await _finish(c) for c in kept.values()]
            for rid in [*kept, *aborted]:
                eng.release(rid)
            # churn with the engine thread running as usual
            for i in range(300):
                collector = DeltaCollector(f"c{i}")
                eng.submit(f"c{i}", [11] * 16, params, collector)
                eng.release(f"c{i}")
                await asyncio.sleep(0)
            return ends, kept_results
        ends, kept_results = asyncio.run(storm())  # raises EngineOverloaded if refused
        assert all(ids == [] and reason == FinishReason.ABORT for ids, reason in ends)
        assert all(len(ids) == 4 and reason == FinishReason.LENGTH for ids, reason in kept_results)
        _wait_idle(eng)
    finally:
        eng.shutdown()
