"""The engine on a GPU: greedy parity of the Triton backend (with decode CUDA graphs
and the pipelined host copy) against the torch backend, and graph replay against the
eager forward. Skipped without CUDA (tests/conftest.py skips the `gpu` marker)."""
import random

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from tests.model_dirs import make_model_dir

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models"), "llama")


def _prompts(n=12, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(rng.randrange(1, 120))] for _ in range(n)]


def _config(model_dir, backend, **kw):
    return EngineConfig(model=model_dir, device="cuda", dtype="float32", attention_backend=backend,
                        max_model_len=512, max_num_seqs=16, **kw)


def _generate(config, disable_graphs=False):
    with Engine(config) as engine:
        runner = engine.core.runner
        if disable_graphs:
            runner.decode_graphs = None
        outs = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
        replays = runner.decode_graphs.num_replays if runner.decode_graphs is not None else 0
    return outs, replays


@pytest.fixture(scope="module")
def torch_reference(model_dir):
    return _generate(_config(model_dir, "torch", num_scheduler_steps=1))[0]


@pytest.mark.parametrize("num_steps", [1, 8])
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_engine_matches_torch_engine(model_dir, torch_reference, num_steps, block_size):
    pytest.importorskip("triton")
    outs, replays = _generate(_config(model_dir, "triton", num_scheduler_steps=num_steps,
                                      block_size=block_size))
    assert replays > 0, "decode steps must run through the captured graphs"
    assert outs == torch_reference


def test_graphs_off_gives_the_same_tokens(model_dir, torch_reference):
    pytest.importorskip("triton")
    outs, replays = _generate(_config(model_dir, "triton", num_scheduler_steps=8), disable_graphs=True)
    assert replays == 0 and outs == torch_reference


def _random_decode(runner, seq_lens, seed=0):
    from replicas.model_runner import StepInputs
    from replicas.attention.base import AttentionMetadata
    from replicas.step_advance import slots_from_block_table
    gen = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    width = -(-(max(seq_lens) + 8) // bs)
    tables = torch.randperm(runner.num_blocks, generator=gen)[:len(seq_lens) * width]
    tables = tables.view(len(seq_lens), width).int().cuda()
    positions = torch.tensor(seq_lens, device="cuda") - 1
    meta = AttentionMetadata(
        slot_mapping=slots_from_block_table(tables, positions, bs), num_prefills=0,
        num_prefill_tokens=0, prefill_query_start_loc=[0], prefill_seq_lens=[],
        prefill_block_tables=None, num_decodes=len(seq_lens),
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        decode_block_tables=tables, max_decode_seq_len=max(seq_lens) + 8)
    ids = torch.randint(5, 8000, (len(seq_lens),), generator=gen).cuda()
    return StepInputs(ids, positions, meta, torch.arange(len(seq_lens), device="cuda"), [])


def _snapshot(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _restore(caches, snapshot):
    for (k, v), (k0, v0) in zip(caches, snapshot):
        k.copy_(k0)
        v.copy_(v0)


def _changed_slots(caches, snapshot):
    changed = set()
    for (k, v), (k0, v0) in zip(caches, snapshot):
        for now, then in ((k, k0), (v, v0)):
            changed.update((now != then).flatten(2).any(-1).flatten().nonzero().flatten().tolist())
    return changed


@torch.inference_mode()
def test_graph_replay_equals_eager_forward_through_a_window(model_dir):
    pytest.importorskip("triton")
    from replicas.cuda_graphs import graph_backend_for_bucket
    from replicas.step_advance import advance_decode_inputs_
    with Engine(_config(model_dir, "triton", num_scheduler_steps=8)) as engine:
        runner = engine.core.runner
        graphs = runner.decode_graphs
        assert graphs is not None
        for k, v in runner.kv_caches:
            k.normal_()
            v.normal_()
        start = _snapshot(runner.kv_caches)
        seq_lens = [1, 15, 16, 17, 200]  # bucket 8: three padded rows
        eager_inputs = _random_decode(runner, seq_lens)
        bucket = graphs.bucket_for(eager_inputs.meta)
        assert bucket == 8
        backend = graph_backend_for_bucket(runner.backend, bucket, runner.model_config.num_kv_heads,
                                           graphs.max_seq_len)
        eager_logits, eager_caches = [], []
        for _ in range(4):  # eager window first, recording logits and caches per step
            x = eager_inputs
            logits = runner.model(x.input_ids, x.positions, runner.kv_caches, x.meta, backend, None)
            eager_logits.append(logits.clone())
            eager_caches.append(_snapshot(runner.kv_caches))
            advance_decode_inputs_(x.input_ids, x.positions, x.meta.decode_seq_lens,
                                   x.meta.slot_mapping, logits.argmax(-1), x.meta.decode_block_tables,
                                   runner.block_size)
        _restore(runner.kv_caches, start)
        inputs = graphs.load_inputs(_random_decode(runner, seq_lens), bucket)
        written = set()
        for step in range(4):
            written.update(inputs.meta.slot_mapping.tolist())
            logits = graphs.replay(bucket, len(seq_lens))
            torch.testing.assert_close(logits, eager_logits[step], atol=1e-4, rtol=1e-4)
            assert torch.equal(logits.argmax(-1), eager_logits[step].argmax(-1))
            for pair, eager_pair in zip(runner.kv_caches, eager_caches[step]):
                torch.testing.assert_close(pair, eager_pair, atol=1e-5, rtol=1e-5)
            assert _changed_slots(runner.kv_caches, start) == written, "padded rows write nothing"
            m = inputs.meta
            advance_decode_inputs_(inputs.input_ids, inputs.positions, m.decode_seq_lens,
                                   m.slot_mapping, eager_logits[step].argmax(-1),
                                   m.decode_block_tables, runner.block_size)


def test_the_kv_cache_is_sized_from_device_memory(model_dir):
    from replicas.kv_cache.kv_budget import GIB, bytes_per_block
    from replicas.kv_cache.memory_profile import profile_cuda_memory
    base = dict(model=model_dir, device="cuda", dtype="float32", attention_backend="torch",
                max_model_len=512, max_num_seqs=16, enforce_eager=True)
    with Engine(EngineConfig(**base)) as engine:
        runner = engine.core.runner
        # plenty of memory: as many blocks as max_num_seqs full sequences use
        assert runner.num_blocks == 16 * -(-(512 + 8) // 16)
        weights = sum(p.nbytes for p in runner.model.parameters())
        memory = profile_cuda_memory(runner.model, runner.backend, runner.config,
                                     runner.model_config, runner.device, 512)
        assert memory.total_bytes == torch.cuda.mem_get_info()[1]
        assert weights < memory.peak_used_bytes < memory.total_bytes
        block_bytes = bytes_per_block(runner.config, runner.model_config)
    # kv_cache_gib caps what free memory allows
    with Engine(EngineConfig(**base, kv_cache_gib=1 / 1024)) as engine:
        assert engine.core.runner.num_blocks == GIB // 1024 // block_bytes
    # a utilization below what the CUDA context and weights take: refused at start
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        Engine(EngineConfig(**base, gpu_memory_utilization=0.001))
