"""The on-device step advance inside a multi-step window computes the same inputs
(input ids, positions, sequence lengths, slots) as the scheduler and prepare_inputs
compute for the next step, for shuffled block tables whose sequences cross block
boundaries inside the window."""
import random

import pytest
import torch

from replicas.kv_cache.block_manager import BlockManager
from replicas.config import EngineConfig, SamplingParams
from replicas.model_runner import ModelRunner
from replicas.request import Request, RequestStatus
from replicas.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from replicas.step_advance import advance_decode_inputs_, slots_from_block_table

NUM_STEPS = 8


class _NullSink:
    def put(self, delta, notify=True):
        pass

    def notify(self):
        pass


def _runner_for_inputs(block_size: int) -> ModelRunner:
    # prepare_inputs needs only the block size and the device: no model is loaded.
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = block_size
    runner.device = torch.device("cpu")
    return runner


def _decoding_requests(rng: random.Random, block_size: int, num_requests: int) -> list[Request]:
    """Requests about to decode; half sit just before a block edge, so the window's
    steps cross into the next block (block size 1: every step does)."""
    reqs = []
    for i in range(num_requests):
        if i % 2 == 0:
            num_tokens = rng.randrange(1, 4) * block_size - rng.randrange(0, min(block_size, 4))
        else:
            num_tokens = rng.randrange(1, 3 * block_size + 8)
        num_tokens = max(2, num_tokens)
        prompt = [rng.randrange(5, 8000) for _ in range(num_tokens - 1)]
        req = Request(f"r{i}", prompt, SamplingParams(temperature=0.0), _NullSink(),
                      frozenset(), 10_000)
        req.output_token_ids.append(rng.randrange(5, 8000))
        req.num_computed_tokens = num_tokens - 1  # only the last sampled token lacks K/V
        reqs.append(req)
    return reqs


def _schedule_window(reqs: list[Request], block_size: int, rng: random.Random) -> SchedulerOutput:
    config = EngineConfig(block_size=block_size, num_scheduler_steps=NUM_STEPS, max_model_len=4096)
    bm = BlockManager(4096, block_size)
    # NOTE: shuffled free list: neighbouring positions live in unrelated blocks.
    free = list(bm._free_block_ids)
    rng.shuffle(free)
    bm._free_block_ids.clear()
    bm._free_block_ids.extend(free)
    scheduler = Scheduler(config, bm)
    for req in reqs:
        bm.allocate(req.block_ids, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        scheduler.running.append(req)
    sched = scheduler.schedule()
    assert sched.num_steps == NUM_STEPS and not sched.prefill_seqs
    assert len(sched.decode_seqs) == len(reqs)
    return sched


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_advance_matches_next_step_prepare_inputs(block_size, seed):
    rng = random.Random(seed * 1000 + block_size)
    reqs = _decoding_requests(rng, block_size, num_requests=7)
    sched = _schedule_window(reqs, block_size, rng)
    runner = _runner_for_inputs(block_size)
    inputs = runner.prepare_inputs(sched)
    meta = inputs.meta
    tables_before = meta.decode_block_tables.clone()
    crossed = 0
    for _ in range(NUM_STEPS - 1):
        sampled = torch.tensor([rng.randrange(5, 8000) for _ in reqs], dtype=torch.int64)
        advance_decode_inputs_(inputs.input_ids, inputs.positions, meta.decode_seq_lens,
                               meta.slot_mapping, sampled, meta.decode_block_tables, block_size)
        # what the engine and scheduler do on the host between two single steps
        for req, token in zip(reqs, sampled.tolist()):
            req.output_token_ids.append(token)
            req.num_computed_tokens += 1
            crossed += req.num_computed_tokens % block_size == 0
        next_step = SchedulerOutput(decode_seqs=[ScheduledSeq(r, r.num_computed_tokens, 1, True)
                                                 for r in reqs])
        expected = runner.prepare_inputs(next_step)
        assert torch.equal(inputs.input_ids, expected.input_ids)
        assert torch.equal(inputs.positions, expected.positions)
        assert torch.equal(meta.decode_seq_lens, expected.meta.decode_seq_lens)
        assert torch.equal(meta.slot_mapping, expected.meta.slot_mapping)
    assert torch.equal(meta.decode_block_tables, tables_before), "tables are fixed in a window"
    assert crossed > 0, "the window must cross a block boundary"


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_slots_from_block_table_matches_the_layout_formula(block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_seqs, max_blocks = 9, 6
    tables = torch.randperm(200, generator=gen)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    tables = tables.to(torch.int32)
    positions = torch.randint(0, max_blocks * block_size, (num_seqs,), generator=gen)
    slots = slots_from_block_table(tables, positions, block_size)
    expected = [int(tables[i, p // block_size]) * block_size + p % block_size
                for i, p in enumerate(positions.tolist())]
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected
