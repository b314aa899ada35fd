"""Where a full-batch decode step's time goes: `python -m loadtests.bench_engine
--roofline` prints it beside the roofline.

B streams are prefilled, then decode windows are timed while every stream decodes;
one more window runs under torch's profiler, with the attention backend's calls
marked, and its time is split into the matrix multiplies (the linear layers and the
lm-head), attention (cache writes and the decode kernel), and the rest (norms, rotary
embeddings, activations, sampling, Python), as shares of that window.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from loadtests.engine.engine_runner import random_prompts
from replicas import Engine, EngineConfig, SamplingParams

GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm")


def _marked(backend, name: str) -> None:
    """Wrap the backend's bound methods so the profiler sees each call as `name`."""
    for method in ("forward", "store_kv"):
        inner = getattr(backend, method)

        def wrapped(*args, _inner=inner, **kwargs):
            with record_function(name):
                return _inner(*args, **kwargs)
        setattr(backend, method, wrapped)


# NOTE: enough output for the prefill's mixed steps and the timed windows, and no more:
# the cache holds every stream at once (kv_cache_gib), so no stream is preempted
MAX_TOKENS = 128


def breakdown(model: str, batch: int, dtype: str, input_len: int, kv_cache_gib: float,
              num_windows: int = 2) -> dict:
    engine = Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=batch,
                                 max_num_batched_tokens=max(2048, input_len),
                                 kv_cache_gib=kv_cache_gib))
    core = engine.core
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for ids in random_prompts(batch, input_len):
        engine.add_request(ids, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in core.requests.values()):
        engine.step()
    engine.step()  # one window to settle
    steps0, start = core.num_steps, time.perf_counter()
    for _ in range(num_windows):
        engine.step()
    step_s = (time.perf_counter() - start) / (core.num_steps - steps0)
    _marked(core.runner.backend, "attention")
    steps0 = core.num_steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.step()
        window_s = time.perf_counter() - start
    num_steps = core.num_steps - steps0
    events = prof.key_averages()
    gemm_s = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e6
    attention_s = sum(e.cpu_time_total for e in events if e.key == "attention") / 1e6
    context_len = max(r.num_tokens for r in core.requests.values())
    engine.shutdown()
    return {"step_ms": step_s * 1e3, "full_batch_tok_s": batch / step_s,
            "gemm_share": gemm_s / window_s, "attention_share": attention_s / window_s,
            "rest_share": 1 - (gemm_s + attention_s) / window_s,
            "context_len": context_len,
            "num_profiled_steps": num_steps}
