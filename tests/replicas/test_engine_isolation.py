"""One request must never take the engine down: when a batched step raises for a
reason tied to one request (its sampling, its inputs, its output sink), only that
request ends with FinishReason.ERROR; every other request ends exactly as if the
failure had not happened, and every KV block is free afterwards. When the cause is
the engine's (a device error, a sampler that fails for anyone, every retry
failing), the step raises and the engine fails as before."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from deltas.types import FinishReason
from replicas import Engine, EngineConfig, SamplingParams
from replicas.sampling import sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CONFIG = dict(model="tiny", num_scheduler_steps=4, async_output=True, max_model_len=256)


def _prompts(n=6, seed=11):
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(**CONFIG)) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine):
    return [o.token_ids for o in engine.generate(_prompts(), GREEDY)]


@pytest.fixture(autouse=True)
def no_hook():
    yield
    sampler.row_fault_hook = None


def _fail_for(request_id: str, after_tokens: int = 0, error=RuntimeError):
    def hook(req):
        if req.request_id == request_id and len(req.output_token_ids) >= after_tokens:
            raise error(f"bad row {request_id}")
    return hook


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()
    engine.core.output.wait()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "every block must be free"


def _run(engine, prompts, params=GREEDY, ids=None, params_by_id=None):
    for rid, p in zip(ids, prompts):
        engine.add_request(p, (params_by_id or {}).get(rid, params), request_id=rid)
    _drain(engine)
    return {rid: engine.output(rid) for rid in ids}


class _FlakySink:
    """Wraps a request's sink; its put raises once the request has 3 tokens."""

    def __init__(self, sink, request_id: str):
        self._sink, self._request_id = sink, request_id

    def put(self, delta, notify=True, wakes=None):
        if delta.token_ids and len(self._sink.output.token_ids) >= 3:
            raise RuntimeError(f"bad row {self._request_id}: its sink")
        self._sink.put(delta, notify, wakes)

    def notify(self):
        self._sink.notify()


def _assert_only_failed(outs, failed: set[str], reference, ids):
    for rid, ref in zip(ids, reference):
        out = outs[rid]
        if rid in failed:
            assert out.finish_reason == FinishReason.ERROR and "bad row" in out.error, out
            assert out.token_ids == ref[:len(out.token_ids)]  # what it got was right
        else:
            assert out.finish_reason == FinishReason.LENGTH and out.error is None
            assert out.token_ids == ref, rid


@pytest.mark.parametrize("after_tokens", [0, 7])  # at its first sampling; mid-window
def test_a_request_whose_sampling_raises_fails_alone(engine, reference, after_tokens):
    ids = [f"a{after_tokens}-{i}" for i in range(6)]
    sampler.row_fault_hook = _fail_for(ids[2], after_tokens)
    outs = _run(engine, _prompts(), ids=ids)
    _assert_only_failed(outs, {ids[2]}, reference, ids)
    # the hook runs once per scheduling decision, so a window may pass first
    assert after_tokens <= len(outs[ids[2]].token_ids) < after_tokens + 5


def test_a_lone_failing_request_does_not_stop_the_engine(engine, reference):
    sampler.row_fault_hook = _fail_for("lone")
    outs = _run(engine, _prompts()[:1], ids=["lone"])
    assert outs["lone"].finish_reason == FinishReason.ERROR
    sampler.row_fault_hook = None
    assert _run(engine, _prompts()[:1], ids=["after"])["after"].token_ids == reference[0]


def test_a_failure_outside_sampling_is_pinned_by_retrying_halves(engine, reference):
    ids = [f"b{i}" for i in range(6)]
    runner = engine.core.runner
    real = runner.prepare_inputs
    calls = []

    def prepare_inputs(sched):
        calls.append(1)
        rows = [s.request.request_id for s in sched.prefill_seqs + sched.decode_seqs]
        if "b4" in rows and len(engine.output("b4").token_ids) >= 5:
            raise RuntimeError("bad row b4: its inputs")
        return real(sched)

    runner.prepare_inputs = prepare_inputs
    try:
        outs = _run(engine, _prompts(), ids=ids)
    finally:
        del runner.prepare_inputs
    _assert_only_failed(outs, {"b4"}, reference, ids)


def test_a_seeded_request_next_to_a_failing_one_samples_as_alone(engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    alone = _run(engine, _prompts()[:1], seeded, ids=["s-alone"])["s-alone"].token_ids
    sampler.row_fault_hook = _fail_for("s-bad", after_tokens=3)
    engine.add_request(_prompts()[1], GREEDY, request_id="s-bad")
    outs = _run(engine, _prompts()[:1], seeded, ids=["s-crowd"])
    assert outs["s-crowd"].token_ids == alone
    assert engine.output("s-bad").finish_reason == FinishReason.ERROR


def test_a_request_that_cannot_get_sampling_memory_fails_alone(engine, reference, monkeypatch):
    # The marked request's top-k candidates cannot get memory, in any batch and alone.
    real = sampler.top_k_rows_draw

    def top_k_rows_draw(logits, width, rp, uniforms):
        if bool((rp.top_k == 7).any()):
            raise MemoryError()
        return real(logits, width, rp, uniforms)

    monkeypatch.setattr(sampler, "top_k_rows_draw", top_k_rows_draw)
    ids = [f"m{i}" for i in range(6)]
    for rid, p in zip(ids, _prompts()):
        engine.add_request(p, GREEDY, request_id=rid)
    marked = SamplingParams(temperature=1.0, top_k=7, max_tokens=24, ignore_eos=True)
    engine.add_request(_prompts()[0], marked, request_id="m-marked")
    _drain(engine)
    out = engine.output("m-marked")
    assert out.finish_reason == FinishReason.ERROR and "SamplingOutOfMemory" in out.error, out
    assert out.token_ids == []
    for rid, ref in zip(ids, reference):
        out = engine.output(rid)
        assert out.finish_reason == FinishReason.LENGTH and out.token_ids == ref, rid


def test_a_batch_too_big_to_sample_is_retried_in_halves(engine, reference, monkeypatch):
    # Logprobs (after the draw) cannot get memory for more than 3 rows at once:
    # every request completes, the seeded one as if it had run alone.
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, logprobs=2, max_tokens=24,
                            ignore_eos=True)
    alone = _run(engine, _prompts()[:1], seeded, ids=["h-alone"])["h-alone"]
    real = sampler._packed_logprobs
    failed_batch_sizes = []

    def packed_logprobs(logits, sampled, num_top):
        if logits.shape[0] > 3:
            failed_batch_sizes.append(logits.shape[0])
            raise MemoryError()
        return real(logits, sampled, num_top)

    monkeypatch.setattr(sampler, "_packed_logprobs", packed_logprobs)
    ids = [f"h{i}" for i in range(6)]
    outs = _run(engine, [*_prompts(), _prompts()[0]], ids=ids + ["h-seeded"],
                params_by_id={"h-seeded": seeded})
    assert failed_batch_sizes and max(failed_batch_sizes) == 7
    assert outs["h-seeded"].token_ids == alone.token_ids
    assert outs["h-seeded"].logprobs == alone.logprobs
    for rid, ref in zip(ids, reference):
        assert outs[rid].finish_reason == FinishReason.LENGTH and outs[rid].token_ids == ref, rid


def test_a_failing_output_sink_ends_only_its_request(engine, reference):
    ids = [f"c{i}" for i in range(6)]
    for rid, p in zip(ids, _prompts()):
        engine.add_request(p, GREEDY, request_id=rid)
    req = engine.core.requests["c1"]
    req.sink = _FlakySink(req.sink, "c1")
    _drain(engine)
    outs = {rid: engine.output(rid) for rid in ids}
    _assert_only_failed(outs, {"c1"}, reference, ids)


def test_engine_faults_still_raise(engine):
    # a sampler that fails for any row (the plain control row too) is the engine's
    def broken(req):
        raise RuntimeError("sampler broken")

    sampler.row_fault_hook = broken
    engine.add_request(_prompts()[0], GREEDY, request_id="d0")
    with pytest.raises(RuntimeError, match="sampler broken"):
        while engine.has_unfinished():
            engine.step()
    sampler.row_fault_hook = None
    engine.abort("d0")
    # a device error is never retried
    runner = engine.core.runner
    calls = []

    def execute(sched, on_step):
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def execute_always_failing(sched, on_step):
        calls.append(1)
        raise ValueError("always")

    runner.execute = execute
    try:
        engine.add_request(_prompts()[0], GREEDY, request_id="d1")
        with pytest.raises(RuntimeError, match="CUDA error"):
            engine.step()
        assert len(calls) == 1
        # a failure that every retry repeats cannot be pinned on a request
        calls.clear()
        runner.execute = execute_always_failing
        with pytest.raises(ValueError, match="always"):
            engine.step()
        assert len(calls) == 2  # the step, then its one request alone
    finally:
        del runner.execute
        engine.abort("d1")
    assert not engine.has_unfinished()


def test_async_engine_keeps_serving_the_other_streams():
    from replicas import AsyncEngine

    eng = AsyncEngine(EngineConfig(**CONFIG))
    sampler.row_fault_hook = _fail_for("bad", after_tokens=4)

    async def collect(rid, prompt):
        ids, last = [], None
        async for delta in eng.generate(rid, prompt, GREEDY):
            ids += delta.token_ids
            last = delta
        return ids, last

    async def main():
        return await asyncio.gather(*(collect(f"ok{i}", p) for i, p in enumerate(_prompts())),
                                    collect("bad", _prompts()[0]))
    try:
        results = asyncio.run(main())
        eng.check_health()  # the engine is alive
        deadline = time.monotonic() + 10  # finished requests are freed at its next step
        while (stats := eng.stats()).num_free_blocks != stats.num_total_blocks \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        eng.shutdown()
    *good, (bad_ids, bad_last) = results
    assert all(len(ids) == 24 and last.finish_reason == FinishReason.LENGTH for ids, last in good)
    assert bad_last.finish_reason == FinishReason.ERROR and 4 <= len(bad_ids) < 24
    assert stats.num_free_blocks == stats.num_total_blocks
