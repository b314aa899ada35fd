"""Prefix caching never changes greedy outputs (each cached run against one with
caching off, so a hit on wrong KV fails): shared system prompts, fully
cached prompts, multi-turn continuations (cached decode blocks), under
multi-step windows, async output, chunked prefill, preemption with eviction and
aborts; every block is free or cached-and-evictable afterwards."""
import random

import pytest

from deltas.types import FinishReason
from replicas import Engine, EngineConfig, SamplingParams
from replicas.kv_cache.block_hash import prompt_block_hashes

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BLOCK_SIZE = 16


def _first_wave(seed=11):
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(5, 8192) for _ in range(n)]  # noqa: E731
    systems = [ids(37), ids(64), ids(50)]
    prompts = [systems[i % 3] + ids(rng.randrange(1, 30)) for i in range(12)]
    prompts.append(list(systems[1]))  # exactly 4 blocks: the last one is recomputed
    prompts.append(list(prompts[0]))  # a duplicate
    prompts.append(prompts[1][:40])  # a prefix of another prompt
    return prompts


def _second_wave(first, first_outputs, seed=12):
    """The next chat turn of half the prompts (prompt + answer + a new message),
    and the first wave again (fully cached now)."""
    rng = random.Random(seed)
    turns = [p + out + [rng.randrange(5, 8192) for _ in range(rng.randrange(3, 20))]
             for p, out in list(zip(first, first_outputs))[::2]]
    return turns + first


def _run(waves, aborts=None, **cfg):
    """Each wave runs to completion before the next is added; returns outputs and the engine."""
    outs = []
    with Engine(EngineConfig(model="tiny", **cfg)) as engine:
        for i, wave in enumerate(waves):
            if aborts and i in aborts:
                outs.append(_run_with_aborts(engine, wave, aborts[i]))
            else:
                outs.append([o.token_ids for o in engine.generate(wave, GREEDY)])
        _assert_all_blocks_back(engine)
    return outs, engine


def _run_with_aborts(engine, wave, aborted_indices):
    ids = [engine.add_request(p, GREEDY) for p in wave]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            for i in aborted_indices:
                engine.abort(ids[i])
    engine.core.output.wait()
    return [engine.output(r) for r in ids]


def _assert_all_blocks_back(engine):
    s = engine.stats()
    assert s.num_running == s.num_waiting == 0
    # free, or cached and evictable
    assert s.num_free_blocks == s.num_total_blocks
    bm = engine.core.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.num_evictable_blocks == bm.num_cached_blocks
    bm.check_consistent()


@pytest.fixture(scope="module")
def waves_and_reference():
    first = _first_wave()
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=1, async_output=False,
                             enable_prefix_caching=False)) as engine:
        ref_first = [o.token_ids for o in engine.generate(first, GREEDY)]
        second = _second_wave(first, ref_first)
        ref_second = [o.token_ids for o in engine.generate(second, GREEDY)]
        assert engine.stats().num_cached_blocks == 0
        assert engine.stats().num_prefix_cache_hit_tokens == 0
    return [first, second], [ref_first, ref_second]


SMALL_KV = dict(num_kv_blocks=24, max_model_len=256)  # forces preemption and eviction


@pytest.mark.parametrize("cfg", [
    dict(num_scheduler_steps=8),
    dict(num_scheduler_steps=2, async_output=False),
    dict(num_scheduler_steps=8, async_output=False, release_per_step=False),
    dict(num_scheduler_steps=1, async_output=True),
    dict(num_scheduler_steps=8, max_num_batched_tokens=16),  # chunked prefill
    dict(num_scheduler_steps=4, **SMALL_KV),
    dict(num_scheduler_steps=1, async_output=True, **SMALL_KV),
    dict(num_scheduler_steps=8, max_num_seqs=3),
], ids=["N8", "N2-sync", "N8-window", "N1-async", "chunked", "preempt-N4", "preempt-N1", "seqs3"])
def test_same_greedy_outputs_with_caching(waves_and_reference, cfg):
    waves, reference = waves_and_reference
    outs, engine = _run(waves, **cfg)
    assert outs == reference
    s = engine.stats()
    # the second wave repeats the first: at least its full blocks are hits
    assert s.num_prefix_cache_hit_tokens >= sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
                                                   for p in waves[0]) // 2
    assert 0.0 < s.prefix_cache_hit_rate < 1.0
    if "num_kv_blocks" in cfg:
        assert s.num_preemptions > 0
        assert engine.core.block_manager.num_evicted_blocks > 0


def test_caching_off_recomputes_everything(waves_and_reference):
    waves, reference = waves_and_reference
    outs, engine = _run(waves[:1], num_scheduler_steps=8, enable_prefix_caching=False)
    assert outs == reference[:1]
    s = engine.stats()
    assert s.num_cached_blocks == 0 and s.num_prefix_cache_hit_tokens == 0
    assert s.prefix_cache_hit_rate == 0.0


def test_blocks_of_a_prompt_are_found_by_its_chained_hashes(waves_and_reference):
    """What a router relies on: the engine caches a prompt's full blocks under
    `prompt_block_hashes` of its token ids; the runs that hit them answer as the
    uncached reference does."""
    waves, reference = waves_and_reference
    prompt, uncached = waves[0][1], reference[0][1]
    with Engine(EngineConfig(model="tiny")) as engine:
        assert engine.generate([prompt], GREEDY)[0].token_ids == uncached
        core = engine.core
        hashes = prompt_block_hashes(prompt, BLOCK_SIZE, core.scheduler.root_block_hash)
        assert len(core.block_manager.find_cached_blocks(hashes, len(hashes))) == len(prompt) // BLOCK_SIZE
        # an identical prompt, twice: each computes only its last block, from the cached KV
        before = core.stats().num_prefix_cache_hit_tokens
        for _ in range(2):
            assert engine.generate([prompt], GREEDY)[0].token_ids == uncached
        assert core.stats().num_prefix_cache_hit_tokens - before == 2 * ((len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE


def test_aborts_leave_the_cache_correct(waves_and_reference):
    waves, reference = waves_and_reference
    aborted = {1, 4, 9, 13, 20}
    outs, engine = _run([waves[0], waves[1], waves[1]], aborts={1: aborted},
                        num_scheduler_steps=4, **SMALL_KV)
    assert outs[0] == reference[0]
    for i, (out, ref) in enumerate(zip(outs[1], reference[1])):
        if i in aborted:
            assert out.finish_reason == FinishReason.ABORT
            assert out.token_ids == ref[:len(out.token_ids)]
        else:
            assert out.token_ids == ref
    # the blocks aborted requests left in the cache serve the rerun correctly
    assert outs[2] == reference[1]
