"""A randomized run of the engine loop on `tiny` with tight KV caches, windows of 1-8
steps, chunked prefill, prefix caching, async output and aborts, the block
accounting checked after every step: a block is referenced exactly by the running
requests that hold it, nobody else holds one, and every block is free at the end."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from replicas import Engine, EngineConfig, SamplingParams

NUM_RUNS = 8


def _check_blocks(engine) -> None:
    core = engine.core
    scheduler, bm = core.scheduler, core.block_manager
    running = {id(r) for r in scheduler.running}
    held = Counter()
    for req in core.requests.values():
        if id(req) not in running:
            assert not req.block_ids, (f"request {req.request_id} holds blocks outside the "
                                       f"running set (finished: {req.is_finished})")
        held.update(req.block_ids)
    for block_id in range(bm.num_blocks):
        assert bm._ref_counts[block_id] == held[block_id], block_id
    assert bm.num_free_blocks == bm.num_blocks - len(held)


def _run(seed: int) -> int:
    rng = random.Random(seed)
    block_size = rng.choice([4, 16])
    config = EngineConfig(model="tiny", num_scheduler_steps=rng.choice([1, 2, 4, 8]),
                          async_output=rng.random() < 0.7, block_size=block_size,
                          num_kv_blocks=rng.randrange(12, 40) * 16 // block_size,
                          max_model_len=160, max_num_seqs=rng.choice([4, 8, 16]),
                          max_num_batched_tokens=rng.choice([16, 64, 256]),
                          enable_prefix_caching=rng.random() < 0.6)
    prefixes = [[rng.randrange(5, 8000) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    steps = 0
    with Engine(config) as engine:
        ids = []
        for _ in range(rng.randrange(20, 60)):
            if rng.random() < 0.5:
                prompt = rng.choice(prefixes) + [rng.randrange(5, 8000)
                                                 for _ in range(rng.randrange(1, 20))]
            else:
                prompt = [rng.randrange(5, 8000) for _ in range(rng.randrange(1, 80))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40),
                                    ignore_eos=rng.random() < 0.8)
            ids.append(engine.add_request(prompt, params))
            for _ in range(rng.randrange(0, 3)):
                engine.step()
                steps += 1
                _check_blocks(engine)
            if ids and rng.random() < 0.15:
                engine.abort(rng.choice(ids))
        while engine.has_unfinished():
            engine.step()
            steps += 1
            _check_blocks(engine)
        engine.core.step()  # frees what finished in the last step's outputs
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    return steps


@pytest.mark.parametrize("seed", range(NUM_RUNS))
def test_block_accounting_holds_after_every_step(seed):
    assert _run(seed) > 0


@pytest.mark.parametrize("num_steps", [1, 8])
def test_a_victim_that_finishes_as_it_is_preempted_gets_no_blocks_again(num_steps):
    """The front request needs a block; the one at the back is preempted for it, and its
    last output, flushed first, finishes it. It leaves `running` with its blocks freed,
    and the loop that had it in its copy of `running` must not reserve for it again."""
    from replicas.config import EngineConfig as Config, SamplingParams as Params
    from replicas.kv_cache.block_manager import BlockManager
    from replicas.request import Request, RequestStatus
    from replicas.scheduler import Scheduler
    from deltas.types import FinishReason

    class NullSink:
        def put(self, delta, notify=True):
            pass

        def notify(self):
            pass

    bm = BlockManager(4, 4)
    front, back = (Request(name, [7] * 7, Params(temperature=0.0), NullSink(), frozenset(), 100)
                   for name in ("front", "back"))

    def flush_outputs():
        back.finish_reason = FinishReason.LENGTH  # its last token was in flight

    scheduler = Scheduler(Config(block_size=4, num_scheduler_steps=num_steps), bm, flush_outputs)
    for req in (front, back):
        req.output_token_ids += [9, 9]
        req.num_computed_tokens = 8  # 2 full blocks: the next token needs a third
        bm.allocate(req.block_ids, 8)
        req.status = RequestStatus.RUNNING
        scheduler.running.append(req)
    out = scheduler.schedule()
    assert scheduler.running == [front] and back.block_ids == []
    assert [s.request for s in out.decode_seqs] == [front]
    held = Counter(front.block_ids)
    assert all(bm._ref_counts[b] == held[b] for b in range(bm.num_blocks))
