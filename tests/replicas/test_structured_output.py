"""Structured outputs in the engine: every constrained output parses and validates,
in windows and single steps, streamed and not; unconstrained neighbours are
untouched; bad or too costly grammars are refused naming the problem."""
import asyncio
import json
import math
import random

import jsonschema
import pytest

from deltas.types import FinishReason
from replicas import Engine, EngineConfig, SamplingParams
from replicas.async_engine import AsyncEngine
from replicas.config import InvalidValue
from structured_output_schemas import SCHEMAS


def _prompts(n, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


@pytest.fixture(scope="module", params=[1, 8], ids=["N1", "N8"])
def engine(request):
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=request.param)) as e:
        yield e


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(engine, name):
    schema = SCHEMAS[name]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=160,
                             structured_output={"json": schema})
              for i, t in enumerate([0.0, 1.0, 1.0, 0.7])]
    prompts = _prompts(4)
    outs = engine.generate(prompts, params)
    for out in outs:
        assert out.finish_reason == FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_outputs_parse_or_are_cut_json(engine):
    """NOTE: a random-weight model inside an open string may not close it within
    max_tokens; such an output is cut ("length") but still a JSON prefix."""
    params = [SamplingParams(temperature=t, seed=i, max_tokens=120,
                             structured_output={"json_object": True})
              for i, t in enumerate([0.0, 0.0, 1.0, 1.0, 1.0, 1.0])]
    outs = engine.generate(_prompts(6, seed=11), params)
    assert any(o.finish_reason == FinishReason.STOP for o in outs)
    for out in outs:
        if out.finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == FinishReason.LENGTH and out.text.startswith("{")
            check = engine.core.grammars.compile({"json_object": True})
            assert check.matcher.consume_tokens(out.token_ids), check.matcher.get_error()


def test_regex_choice_and_lark(engine):
    regex = SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                           structured_output={"regex": "[a-z]{2,6}-[0-9]{1,3}"})
    choice = SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                            structured_output={"choice": ["yes", "no", "maybe"]})
    lark = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_output={
        "grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'})
    r, c, g = engine.generate(_prompts(3), [regex, choice, lark])
    import re
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", r.text)
    assert c.text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", g.text)


def test_unconstrained_neighbours_keep_their_tokens(engine):
    prompts = _prompts(8, seed=9)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = engine.generate(prompts[:4], free)
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=60,
                                 structured_output={"json": SCHEMAS["nested"]})
    mixed = engine.generate(prompts[:4] + prompts[4:], [free] * 4 + [constrained] * 4)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for out in mixed[4:]:
        jsonschema.validate(json.loads(out.text), SCHEMAS["nested"])


def test_streamed_outputs_validate_one_token_per_delta():
    schema = SCHEMAS["array_of_objects"]
    eng = AsyncEngine(EngineConfig(model="tiny", num_scheduler_steps=8))

    async def one(i, prompt):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                                structured_output={"json": schema})
        ids, sizes, last = [], [], None
        async for delta in eng.generate(f"r{i}", prompt, params):
            ids += delta.token_ids
            sizes.append(len(delta.token_ids))
            last = delta
        return ids, sizes, last

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(_prompts(6))])
    try:
        results = asyncio.run(main())
    finally:
        eng.shutdown()
    from deltas.tokenization.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(eng.core.model_dir)
    for ids, sizes, last in results:
        assert last.finish_reason == FinishReason.STOP
        # NOTE: a reader that falls behind gets merged deltas, so only "in pieces"
        assert len(sizes) >= 2 and min(sizes) <= 1
        jsonschema.validate(json.loads(tok.decode(ids)), schema)


@pytest.mark.parametrize("spec, problem", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "Invalid type: strin"),
    ({"json": {"type": "object", "required": "name"}}, "required"),
    ({"regex": "[a-z"}, "unclosed character class"),
    ({"grammar": "start: foo"}, "foo"),
])
def test_invalid_grammars_are_refused_naming_the_problem(engine, spec, problem):
    with pytest.raises(InvalidValue, match="structured_output") as info:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_output=spec))
    assert problem in str(info.value) and info.value.param == "structured_output"


@pytest.mark.parametrize("spec", [{"xml": "<a/>"}, {"json": 3}, {"choice": []},
                                  {"json_object": False}, "json"])
def test_malformed_specs_are_refused_by_sampling_params(spec):
    with pytest.raises(InvalidValue, match="structured_output"):
        SamplingParams(structured_output=spec)


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 3}])
def test_a_grammar_refuses_ignore_eos_and_min_tokens(extra):
    """A complete grammar allows only EOS: with EOS banned no token would be left."""
    with pytest.raises(InvalidValue, match="ignore_eos or min_tokens") as info:
        SamplingParams(max_tokens=8, structured_output={"regex": "[ab]{2}"}, **extra)
    assert info.value.param == "structured_output"


def test_compile_past_its_time_is_refused(engine):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{3,9}$"}
                                               for i in range(200)}}
    with pytest.raises(InvalidValue, match="could not be compiled within"):
        engine.core.grammars.compile({"json": schema}, timeout_s=1e-6)


def test_an_awaited_compile_leaves_the_event_loop_running(engine, monkeypatch):
    """An engine replica admits on its event loop: a slow compile must not stop it
    (every stream of the replica would wait), and its time limit still holds."""
    import time

    from replicas.sampling.structured_output import GrammarCompiler

    compile_for_real = GrammarCompiler._compile

    # NOTE: a blocked loop would stall 1.2 s; a free one, on a loaded machine, still
    # stalls ~0.3 s now and then (seen beside the suite's other lanes): 0.7 s between
    def slow_compile(self, spec):
        time.sleep(1.2)
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    grammars = engine.core.grammars

    async def run():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.ensure_future(tick())
        matcher = await grammars.compile_async({"regex": "[ab]{2}"})
        with pytest.raises(InvalidValue, match="could not be compiled within 0.1 s"):
            await grammars.compile_async({"regex": "[ab]{3}"}, timeout_s=0.1)
        done.set()
        await ticker
        return matcher, max(gaps)

    matcher, longest_gap_s = asyncio.run(run())
    assert matcher.matcher is not None and not matcher.matcher.is_error()
    assert longest_gap_s < 0.7, longest_gap_s  # a blocked loop: 1.2 s at least


def test_a_grammar_that_fails_ends_its_request_with_an_error(monkeypatch):
    """Without its mask a row samples what its grammar rejects: the request ends
    with an error delta at that token (not a silent stop); its neighbour completes."""
    from replicas.sampling.structured_output import GrammarBatch

    monkeypatch.setattr(GrammarBatch, "mask_logits_", lambda self, logits: None)
    eng = AsyncEngine(EngineConfig(model="tiny", num_scheduler_steps=4))

    async def run(request_id, params):
        ids, last = [], None
        async for delta in eng.generate(request_id, [5, 6, 7], params):
            ids += delta.token_ids
            last = delta
        return ids, last

    async def main():
        return await asyncio.gather(
            run("bad", SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                      structured_output={"regex": "a{30}"})),
            run("free", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    try:
        (bad_ids, bad), (free_ids, free) = asyncio.run(main())
    finally:
        eng.shutdown()
    assert bad.finish_reason == FinishReason.ERROR
    assert "structured output's grammar failed at output token" in bad.error, bad.error
    failed_at = int(bad.error.split("output token ")[1].split(":")[0])
    assert bad.num_output_tokens == failed_at - 1 == len(bad_ids)
    assert free.finish_reason == FinishReason.LENGTH and len(free_ids) == 12


def test_pipelined_host_copy_keeps_masks_on_the_previous_token():
    """The CUDA ordering (step k enqueued before step k-1's ids are read), run on
    CPU: constrained rows must still see every earlier token before sampling."""
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=8)) as e:
        e.core.runner.pipelined_host_copy = True
        free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        params = [free] * 3 + [SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                                              structured_output={"json": SCHEMAS["enum"]})
                               for i in range(3)]
        outs = e.generate(_prompts(6, seed=13), params)
        e.core.runner.pipelined_host_copy = False
        alone = e.generate(_prompts(6, seed=13)[:3], free)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in alone]
    for out in outs[3:]:
        assert out.finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(out.text), SCHEMAS["enum"])


def test_logprobs_of_a_constrained_row_are_the_models_own_and_finite():
    """The grammar's mask sets forbidden logits to -inf; logprobs are taken before it
    (the model's distribution, as for every other sampling parameter), so all 20
    alternatives are finite, and the first token's are those of the same prompt
    unconstrained."""
    eng = AsyncEngine(EngineConfig(model="tiny", num_scheduler_steps=4))

    async def first_tops(request_id, **extra):
        params = SamplingParams(max_tokens=4, temperature=0, logprobs=20, **extra)
        deltas = [d async for d in eng.generate(request_id, [5, 6, 7], params)]
        tops = [alts for d in deltas for alts in (d.top_logprobs or [])]
        lps = [lp for d in deltas for lp in (d.logprobs or [])]
        return lps, tops

    async def run():
        constrained = await first_tops("c", structured_output={"choice": ["yes", "no"]})
        free = await first_tops("f")
        return constrained, free

    try:
        (lps, tops), (_, free_tops) = asyncio.run(run())
    finally:
        eng.shutdown()
    assert tops and all(len(alts) == 20 for alts in tops)
    assert all(math.isfinite(lp) for lp in lps)
    assert all(math.isfinite(lp) for alts in tops for _, lp in alts), tops
    assert [t for t, _ in tops[0]] == [t for t, _ in free_tops[0]]
