"""Grammar compiles under load (replicas/sampling/compile_lanes.py and
GrammarCompiler): a compile's time limit counts the compile alone, not its wait
for a worker; a grammar asked for by many requests at once (or `n` choices)
compiles once and is kept by its text; a large grammar never delays a small
one; a full queue is "busy", not "invalid"."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from replicas.checkpoints.presets import resolve_tokenizer_dir
from replicas.config import InvalidValue
from replicas.sampling.compile_lanes import CompileLanes, LanesBusy
from replicas.sampling.grammar_text import grammar_text
from replicas.sampling.structured_output import GrammarCompiler

VOCAB_SIZE = 8192


@pytest.fixture(scope="module")
def model_dir():
    return resolve_tokenizer_dir("tiny")


def _compiler(model_dir, monkeypatch, delay_s: float, calls: list,
              longer_than: int = 0) -> GrammarCompiler:
    """A compiler whose compiles (of texts longer than `longer_than`) each take
    `delay_s` more, counted in `calls`."""
    compiler = GrammarCompiler(model_dir, VOCAB_SIZE, [0])
    compile_for_real = compiler._compile

    def slow_compile(text):
        calls.append(text)
        if len(text) > longer_than:
            time.sleep(delay_s)
        return compile_for_real(text)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    return compiler


def test_the_time_limit_counts_the_compile_not_its_wait(model_dir, monkeypatch):
    """Twelve different grammars at once, each 0.3 s to compile, with a limit of
    0.6 s: all compile (a limit counting the queue failed the later ones)."""
    calls = []
    compiler = _compiler(model_dir, monkeypatch, 0.3, calls)

    async def run():
        return await asyncio.gather(*[
            compiler.compile_async({"regex": f"[ab]{{{i + 1}}}"}, timeout_s=0.6)
            for i in range(12)], return_exceptions=True)

    results = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert len(calls) == 12


def test_one_grammar_asked_at_once_compiles_once_and_is_kept(model_dir, monkeypatch):
    calls = []
    compiler = _compiler(model_dir, monkeypatch, 0.2, calls)
    spec = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}

    async def run():
        return await asyncio.gather(*[compiler.compile_async(spec) for _ in range(4)])

    matchers = asyncio.run(run())
    assert len(calls) == 1
    # each choice gets a matcher of its own: feeding one leaves the others at the start
    first = matchers[0].matcher
    assert len({id(m.matcher) for m in matchers}) == 4
    token = next(t for t in range(VOCAB_SIZE) if first.validate_tokens([t]) == 1)
    assert first.consume_token(token)
    assert matchers[1].matcher.validate_tokens([token]) == 1
    # later, the same text again (as the ingress sends it): no compile at all
    compiler.compile({"llguidance": grammar_text(spec)})
    assert len(calls) == 1 and len(compiler.compiled) == 1


def test_a_large_grammar_never_delays_a_small_one(model_dir, monkeypatch):
    calls = []
    compiler = _compiler(model_dir, monkeypatch, 1.5, calls, longer_than=64 * 1024)
    large = {"choice": [f"option-{i:05d}-" + "x" * 60 for i in range(1200)]}  # ~80 KB of text
    assert len(grammar_text(large)) > 64 * 1024
    finished = {}

    async def timed(name, spec):
        await compiler.compile_async(spec, timeout_s=5.0)
        finished[name] = time.monotonic()

    async def run():
        big = asyncio.ensure_future(timed("large", large))
        await asyncio.sleep(0.1)  # the large one holds its lane's worker
        await timed("small", {"regex": "[ab]{2}"})
        await big

    asyncio.run(run())
    assert finished["small"] < finished["large"]


def test_a_full_queue_is_busy_not_invalid():
    lanes = CompileLanes("test", max_queued_per_lane=2, queue_timeout_s=0.2)
    release = threading.Event()
    lanes.submit("running", 1, release.wait)  # takes the small lane's one worker
    time.sleep(0.05)
    lanes.submit("queued-1", 1, lambda: 1)
    lanes.submit("queued-2", 1, lambda: 2)
    with pytest.raises(LanesBusy, match="2 grammars wait"):
        lanes.submit("queued-3", 1, lambda: 3)
    with pytest.raises(LanesBusy, match="no worker was free within 0.2 s"):
        lanes.run("queued-1", 1, lambda: 1, timeout_s=1.0)  # joins it, waits, gives up
    release.set()
    assert lanes.run("queued-2", 1, lambda: 0, timeout_s=1.0) == 2  # joined, not run again
    assert lanes.run("again", 1, lambda: 7, timeout_s=1.0) == 7


def test_an_invalid_grammar_is_refused_by_every_waiter(model_dir, monkeypatch):
    compiler = _compiler(model_dir, monkeypatch, 0.0, [])

    async def run():
        return await asyncio.gather(*[compiler.compile_async({"grammar": "start: nope"})
                                      for _ in range(3)], return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, InvalidValue) and "nope" in str(r) for r in results), results
