"""CUDA-graph decode plumbing on CPU: bucket lists and choice, the padded copy into
static buffers, the graph runner over those buffers (an eager stand-in replaces the
CUDA graph), and the model runner's pipelined host-copy path. Real capture and
replay run in tests/gpu/test_gpu_engine.py."""
import random
from types import SimpleNamespace

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.attention.base import AttentionMetadata
from replicas.attention.torch_backend import TorchAttentionBackend
from replicas.cuda_graphs import (DecodeGraphRunner, EagerStandInGraph, StaticDecodeInputs,
                                  choose_bucket, decode_buckets, fill_static_decode_inputs_,
                                  graph_backend_for_bucket, start_host_copy, why_no_decode_graphs)
from replicas.model_runner import StepInputs
from replicas.models.loader import load_model
from replicas.checkpoints.presets import ensure_model_dir
from replicas.step_advance import advance_decode_inputs_, slots_from_block_table


# -- buckets -------------------------------------------------------------------------
@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (5, [1, 2, 4, 5]),
    (8, [1, 2, 4, 8]),
    (16, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    (256, [1, 2, 4, 8] + list(range(16, 257, 16))),
])
def test_decode_buckets(max_num_seqs, expected):
    assert decode_buckets(max_num_seqs) == expected


def test_decode_buckets_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


@pytest.mark.parametrize("num_seqs,expected", [
    (0, None), (1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, 32),
    (200, 208), (256, 256), (257, None),
])
def test_choose_bucket(num_seqs, expected):
    assert choose_bucket(decode_buckets(256), num_seqs) == expected


def test_every_count_gets_the_smallest_bucket_that_holds_it():
    buckets = decode_buckets(100)
    for n in range(1, 101):
        bucket = choose_bucket(buckets, n)
        assert bucket >= n and not any(n <= b < bucket for b in buckets)


# -- the padded copy --------------------------------------------------------------------
def _garbage_static(num_rows=16, width=10) -> StaticDecodeInputs:
    static = StaticDecodeInputs.allocate(num_rows, width, "cpu")
    for t in (static.input_ids, static.positions, static.slot_mapping, static.seq_lens,
              static.block_tables):
        t.fill_(7777)
    return static


def test_fill_copies_live_rows_and_pads_the_bucket():
    static = _garbage_static()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (3,), generator=gen)
    positions = torch.tensor([0, 16, 40])
    tables = torch.randint(0, 50, (3, 4), generator=gen, dtype=torch.int32)
    slots = slots_from_block_table(tables, positions, 16)
    seq_lens = (positions + 1).int()
    fill_static_decode_inputs_(static, 8, ids, positions, slots, seq_lens, tables)
    assert torch.equal(static.input_ids[:3], ids)
    assert torch.equal(static.positions[:3], positions)
    assert torch.equal(static.slot_mapping[:3], slots)
    assert torch.equal(static.seq_lens[:3], seq_lens)
    assert torch.equal(static.block_tables[:3, :4], tables)
    assert (static.block_tables[:3, 4:] == 0).all(), "no stale block ids past the live width"
    # padded rows of the bucket: write nothing, read nothing
    assert (static.slot_mapping[3:8] == -1).all()
    assert (static.seq_lens[3:8] == 0).all()
    assert (static.input_ids[3:8] == 0).all() and (static.positions[3:8] == 0).all()
    assert (static.block_tables[3:8] == 0).all()
    # rows past the bucket are not the graph's business: untouched
    assert (static.input_ids[8:] == 7777).all() and (static.slot_mapping[8:] == 7777).all()


def test_fill_rejects_what_does_not_fit():
    static = _garbage_static(num_rows=8, width=4)
    ids = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="bucket"):
        fill_static_decode_inputs_(static, 4, ids, ids, ids, ids.int(),
                                   torch.zeros(5, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="exceed"):
        fill_static_decode_inputs_(static, 8, ids, ids, ids, ids.int(),
                                   torch.zeros(5, 5, dtype=torch.int32))


# -- when graphs apply -------------------------------------------------------------------
class _Named:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("device,eager,backend,allowed", [
    ("cpu", False, "triton", False),
    ("cuda", False, "triton", True),
    ("cuda", False, "flash-attn", True),
    ("cuda", True, "triton", False),
    ("cuda", False, "torch", False),
])
def test_why_no_decode_graphs(device, eager, backend, allowed):
    config = SimpleNamespace(enforce_eager=eager)
    reason = why_no_decode_graphs(config, torch.device(device), _Named(backend))
    assert (reason is None) == allowed


def test_config_without_enforce_eager_allows_graphs_on_cuda():
    assert why_no_decode_graphs(EngineConfig(), torch.device("cuda"), _Named("triton")) is None


def test_graph_backend_fixes_the_triton_split_count():
    assert graph_backend_for_bucket(torch_backend := TorchAttentionBackend(), 8, 8, 4096) is torch_backend
    pytest.importorskip("triton")
    from replicas.attention.triton_backend import TritonAttentionBackend
    base = TritonAttentionBackend(tile_tokens=32)
    splits = set()
    for bucket in (1, 64, 256):
        fixed = graph_backend_for_bucket(base, bucket, 8, 4096)
        assert fixed is not base and fixed.tile_tokens == 32
        n = fixed.num_kv_splits
        assert n is not None and n & (n - 1) == 0
        # the split count no longer depends on the step's lengths
        assert fixed.kv_splits_for(bucket, 8, 17) == fixed.kv_splits_for(bucket, 8, 4000) == n
        splits.add(n)
    assert len(splits) > 1, "small buckets split the KV more than large ones"
    assert graph_backend_for_bucket(TritonAttentionBackend(num_kv_splits=4), 1, 8, 4096).num_kv_splits == 4


# -- the graph runner over static buffers (CPU stand-in for the CUDA graph) -----------------
BLOCK_SIZE = 16
MAX_BLOCKS = 8


@pytest.fixture(scope="module")
def small_model():
    return load_model(ensure_model_dir("tiny"), "float32", torch.device("cpu"),
                      MAX_BLOCKS * BLOCK_SIZE + 8)


def _random_caches(model, num_blocks=40, seed=0):
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(cfg.num_layers)]


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _caches_equal(a, b):
    return all(torch.equal(x, y) for pair_a, pair_b in zip(a, b) for x, y in zip(pair_a, pair_b))


def _live_decode(seq_lens: list[int], seed=0):
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(40, generator=gen)[:len(seq_lens) * 5].view(len(seq_lens), 5).int()
    positions = torch.tensor(seq_lens) - 1
    meta = AttentionMetadata(
        slot_mapping=slots_from_block_table(tables, positions, BLOCK_SIZE), num_prefills=0,
        num_prefill_tokens=0, prefill_query_start_loc=[0], prefill_seq_lens=[],
        prefill_block_tables=None, num_decodes=len(seq_lens),
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32), decode_block_tables=tables,
        max_decode_seq_len=max(seq_lens) + 3)
    ids = torch.randint(5, 8000, (len(seq_lens),), generator=gen)
    return StepInputs(ids, positions, meta, torch.arange(len(seq_lens)), [])


def _graph_runner(model, caches, max_num_seqs=8):
    return DecodeGraphRunner(model, caches, TorchAttentionBackend(), max_num_seqs, MAX_BLOCKS,
                             BLOCK_SIZE, model.config.vocab_size, model.config.num_kv_heads, "cpu",
                             make_graph=EagerStandInGraph)


def test_capture_writes_nothing_to_the_kv_cache(small_model):
    caches = _random_caches(small_model)
    before = _clone(caches)
    graphs = _graph_runner(small_model, caches)
    graphs.capture()
    assert sorted(graphs._graphs) == [1, 2, 4, 8]
    assert _caches_equal(caches, before), "padded rows must write nothing"


def _changed_slots(caches, initial) -> set[int]:
    changed = set()
    for (k, v), (k0, v0) in zip(caches, initial):
        for now, then in ((k, k0), (v, v0)):
            rows = (now != then).flatten(2).any(-1).flatten()  # (num_blocks * block_size,)
            changed.update(rows.nonzero().flatten().tolist())
    return changed


def test_replay_equals_eager_forward_through_a_window(small_model):
    caches = _random_caches(small_model)
    initial, eager_caches = _clone(caches), _clone(caches)
    graphs = _graph_runner(small_model, caches)
    graphs.capture()
    live = _live_decode([17, 1, 33], seed=1)  # crosses a block edge within the window
    eager_inputs = _live_decode([17, 1, 33], seed=1)
    bucket = graphs.bucket_for(live.meta)
    assert bucket == 4
    inputs = graphs.load_inputs(live, bucket)
    backend = TorchAttentionBackend()
    written: set[int] = set()
    for _ in range(3):
        written.update(eager_inputs.meta.slot_mapping.tolist())
        logits = graphs.replay(bucket, 3)
        expected = small_model(eager_inputs.input_ids, eager_inputs.positions, eager_caches,
                               eager_inputs.meta, backend, None)
        assert logits.shape == expected.shape == (3, small_model.config.vocab_size)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        for pair, eager_pair in zip(caches, eager_caches):
            torch.testing.assert_close(pair, eager_pair, atol=1e-5, rtol=1e-5)
        # the padded 4th row wrote nothing: only the live rows' slots changed
        assert _changed_slots(caches, initial) == written
        sampled = logits.argmax(-1)
        for x in (inputs, eager_inputs):
            advance_decode_inputs_(x.input_ids, x.positions, x.meta.decode_seq_lens,
                                   x.meta.slot_mapping, sampled, x.meta.decode_block_tables,
                                   BLOCK_SIZE)
    assert graphs.num_replays == 3
    assert (graphs.static.slot_mapping[3:4] == -1).all() and graphs.static.seq_lens[3] == 0


def test_bucket_for_declines_what_graphs_cannot_run(small_model):
    graphs = _graph_runner(small_model, _random_caches(small_model), max_num_seqs=4)
    graphs.capture()
    assert graphs.bucket_for(_live_decode([3] * 5).meta) is None  # more rows than the largest bucket
    wide = _live_decode([3, 4])
    wide.meta.decode_block_tables = torch.zeros(2, MAX_BLOCKS + 1, dtype=torch.int32)
    assert graphs.bucket_for(wide.meta) is None
    mixed = _live_decode([3, 4])
    mixed.meta.num_prefills = 1
    assert graphs.bucket_for(mixed.meta) is None


# -- the model runner's hooks, on CPU --------------------------------------------------------
class _CountingModel(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.num_calls = 0

    def forward(self, *args):
        self.num_calls += 1
        return self.inner(*args)


def _prompts(n=6, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_outputs():
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=1, max_model_len=256)) as engine:
        return [o.token_ids for o in engine.generate(_prompts(), GREEDY)]


def _with_graph_hooks(engine, num_steps_log):
    """Turn on what CUDA turns on (graphs via the stand-in, pipelined host copy) and
    record, at each on_step, how many forwards the window had issued."""
    runner = engine.core.runner
    counting = _CountingModel(runner.model)
    runner.model = counting
    mc = runner.model_config
    runner.decode_graphs = DecodeGraphRunner(counting, runner.kv_caches, runner.backend,
                                             engine.config.max_num_seqs, -(-(256 + 8) // 16), 16,
                                             mc.vocab_size, mc.num_kv_heads, "cpu",
                                             make_graph=EagerStandInGraph)
    runner.decode_graphs.capture()
    runner.pipelined_host_copy = True
    execute = runner.execute

    def spying_execute(sched, on_step):
        start = counting.num_calls

        def spy(step, rows, sampled):
            num_steps_log.append((sched.num_steps, step, counting.num_calls - start))
            on_step(step, rows, sampled)
        execute(sched, spy)
    runner.execute = spying_execute
    return runner


@pytest.mark.parametrize("async_output", [True, False])
def test_pipelined_graph_path_keeps_greedy_outputs(reference_outputs, async_output):
    log = []
    config = EngineConfig(model="tiny", num_scheduler_steps=8, max_model_len=256, max_num_seqs=8,
                          async_output=async_output)
    with Engine(config) as engine:
        runner = _with_graph_hooks(engine, log)
        outs = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
    assert outs == reference_outputs
    assert runner.decode_graphs.num_replays > 0
    windows = [(n, step, calls) for n, step, calls in log if n > 1]
    assert windows
    for num_steps, step, calls in windows:
        # step k is handed to output processing only once step k+1 was issued
        assert calls == min(step + 2, num_steps), (num_steps, step, calls)


def test_host_copy_on_cpu_is_a_private_copy():
    packed = torch.arange(6)
    pending = start_host_copy(packed)
    packed.add_(100)  # the window advances its tensors in place
    assert pending.event is None and pending.host.tolist() == list(range(6))
