"""Where a full-batch decode step's time goes on a GPU (`python -m loadtests.gpu_check`'s
step_profile part).

The Llama-3.1-8B shape with random bf16 weights drawn on the device (as
`loadtests.gpu_check` does), B streams prefilled, then decode windows timed while every
stream decodes, for N=8 and N=1, with the captured decode graphs, then the same
windows eager (the graphs set aside), then eager and with graphs captured again with
torch's operators in place of the Triton layer ops (replicas/models/triton_layer_ops.py).
One more window runs under torch's profiler with CPU
and CUDA activities, so the step splits into GPU busy time (kernels, by name) and the
host's time around it: a step whose wall time is far above its kernels' is bound by
the host (scheduling, sampling bookkeeping, output processing, launches).
The caller patches the model loader (random weights, no files); on CPU the same code
runs the tiny shape, to check the plumbing.
"""
from __future__ import annotations

import gc
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from replicas import Engine, EngineConfig, SamplingParams


def _device_us(event) -> float:
    # NOTE: torch renamed cuda_time_total to device_time_total; read either
    return float(getattr(event, "self_device_time_total", None)
                 or getattr(event, "self_cuda_time_total", 0.0) or 0.0)


def profile_windows(model_dir: str, vocab_size: int, on_cuda: bool, batch: int, input_len: int,
                    num_steps: int, num_windows: int = 6) -> dict:
    """Step time of full-batch decode windows of num_steps steps, and one window's
    kernels (CUDA) and host operators, per step."""
    config = EngineConfig(model=model_dir, device="cuda" if on_cuda else "cpu",
                          dtype="bfloat16" if on_cuda else "float32",
                          max_model_len=4096 if on_cuda else 256, max_num_seqs=batch,
                          kv_cache_gib=24.0 if on_cuda else 0.25,
                          max_num_batched_tokens=4096 if on_cuda else 512,
                          num_scheduler_steps=num_steps, release_per_step=True)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    engine = Engine(config)
    try:
        core = engine.core
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        rng = random.Random(0)
        for _ in range(batch):
            engine.add_request([rng.randrange(5, vocab_size) for _ in range(input_len)], params)
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in core.requests.values()):
            engine.step()
        for _ in range(2):  # settle: graphs warm, outputs flowing
            engine.step()
        step_ms = _timed_step_ms(engine, num_windows, sync)
        runner = core.runner
        graphs, eager_step_ms, eager_torch_ops_step_ms = runner.decode_graphs, None, None
        graph_torch_ops_step_ms = None
        if graphs is not None:  # the same windows without the captured graphs
            runner.decode_graphs = None
            try:
                engine.step()  # settle: first eager launches out of the timing
                eager_step_ms = _timed_step_ms(engine, num_windows, sync)
                # and with torch's operators for RMSNorm, rotary and SiLU x up
                runner.model.native_layer_ops = False
                engine.step()
                eager_torch_ops_step_ms = _timed_step_ms(engine, num_windows, sync)
            finally:
                runner.model.native_layer_ops = True
                runner.decode_graphs = graphs
            graph_torch_ops_step_ms = _recaptured_torch_ops_step_ms(engine, num_windows, sync)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        steps0 = core.num_steps
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            engine.step()
            sync()
            window_ms = (time.perf_counter() - start) * 1e3
        profiled_steps = core.num_steps - steps0
        events = prof.key_averages()
        kernels = sorted(((e.key, _device_us(e)) for e in events if _device_us(e) > 0),
                         key=lambda kv: -kv[1])
        device_busy_ms = sum(us for _, us in kernels) / 1e3
        host = sorted(((e.key, e.self_cpu_time_total) for e in events), key=lambda kv: -kv[1])
        return {
            "num_steps": num_steps, "batch": batch, "step_ms": step_ms,
            "layer_ops": layer_ops_in_use(runner),
            "eager_step_ms": eager_step_ms,
            "graph_vs_eager_step_time": step_ms / eager_step_ms if eager_step_ms else None,
            "eager_torch_ops_step_ms": eager_torch_ops_step_ms,
            "graph_torch_ops_step_ms": graph_torch_ops_step_ms,
            "layer_ops_vs_torch_ops_graph_step_time": (step_ms / graph_torch_ops_step_ms
                                                       if graph_torch_ops_step_ms else None),
            "layer_ops_vs_torch_ops_eager_step_time": (eager_step_ms / eager_torch_ops_step_ms
                                                       if eager_torch_ops_step_ms else None),
            "full_batch_tok_s": batch / step_ms * 1e3,
            "profiled_window_ms": window_ms, "profiled_steps": profiled_steps,
            "device_busy_ms_per_step": device_busy_ms / max(1, profiled_steps),
            "device_busy_share": device_busy_ms / window_ms,
            "top_kernels_ms_per_step": [(k, us / 1e3 / max(1, profiled_steps)) for k, us in kernels[:15]],
            "top_host_self_ms_per_step": [(k, us / 1e3 / max(1, profiled_steps)) for k, us in host[:25]],
        }
    finally:
        engine.shutdown()
        # NOTE: the next engine of the part sizes its KV cache from the memory left
        del engine
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()


def layer_ops_in_use(runner) -> str:
    """Which kernels run RMSNorm, rotary and SiLU x up in this engine's model."""
    ops = runner.model.layer_ops(torch.empty(0, dtype=runner.model.embed_tokens.weight.dtype,
                                             device=runner.device))
    if ops is not None:
        return type(ops).__name__
    problem = None
    if runner.device.type == "cuda":
        from replicas.models.triton_layer_ops import load_triton_layer_ops
        problem = load_triton_layer_ops(runner.device, runner.model.embed_tokens.weight.dtype)[1]
    return "torch operators" + (f" ({problem})" if problem else "")


def _recaptured_torch_ops_step_ms(engine, num_windows: int, sync) -> float:
    """Step time of graph windows captured again with torch's operators in place of the
    layer ops (the engine's own graphs are put back after)."""
    from replicas.cuda_graphs import build_decode_graphs
    core = engine.core
    runner, mc = core.runner, core.runner.model_config
    graphs = runner.decode_graphs
    runner.model.native_layer_ops = False
    try:
        runner.decode_graphs = build_decode_graphs(
            runner.config, runner.model, runner.kv_caches, runner.backend, mc.num_kv_heads,
            mc.vocab_size, runner.device, core.max_model_len)
        engine.step()
        return _timed_step_ms(engine, num_windows, sync)
    finally:
        runner.model.native_layer_ops = True
        runner.decode_graphs = graphs


def _timed_step_ms(engine, num_windows: int, sync) -> float:
    """Wall time per decode step over num_windows engine steps (windows), device drained."""
    core = engine.core
    sync()
    steps0, start = core.num_steps, time.perf_counter()
    for _ in range(num_windows):
        engine.step()
    sync()
    return (time.perf_counter() - start) * 1e3 / (core.num_steps - steps0)


class StepMix:
    """Where a whole run's engine time goes by kind of step: each call of the runner's
    `execute` (one decode window, or one step holding prefill chunks) timed by the
    wall clock, with its rows. A window's ids are on the host when `execute` returns,
    so the times add up to the engine's busy time."""

    SMALL_BATCH = 64  # decode windows below this many rows: the run's tail

    def __init__(self, runner) -> None:
        self.calls: list[tuple[int, int, int, float]] = []  # prefill tokens, decode rows, steps, s
        self._runner, self._execute = runner, runner.execute

        def timed(sched, on_step):
            start = time.perf_counter()
            try:
                return self._execute(sched, on_step)
            finally:
                self.calls.append((sched.num_prefill_tokens, len(sched.decode_seqs),
                                   sched.num_steps, time.perf_counter() - start))
        runner.execute = timed

    def restore(self) -> None:
        self._runner.execute = self._execute

    def summary(self) -> dict:
        mixed = [c for c in self.calls if c[0] > 0]
        decode = [c for c in self.calls if c[0] == 0]
        small = [c for c in decode if c[1] < self.SMALL_BATCH]
        decode_steps = sum(c[2] for c in decode)
        return {
            "prefill_or_mixed": {"calls": len(mixed), "seconds": sum(c[3] for c in mixed),
                                 "prefill_tokens": sum(c[0] for c in mixed),
                                 "decode_tokens": sum(c[1] for c in mixed)},
            "decode_windows": {"calls": len(decode), "steps": decode_steps,
                               "seconds": sum(c[3] for c in decode),
                               "decode_tokens": sum(c[1] * c[2] for c in decode),
                               "mean_rows": (sum(c[1] * c[2] for c in decode) / decode_steps
                                             if decode_steps else 0.0),
                               "ms_per_step": (1e3 * sum(c[3] for c in decode) / decode_steps
                                               if decode_steps else 0.0)},
            f"decode_windows_below_{self.SMALL_BATCH}_rows": {
                "steps": sum(c[2] for c in small), "seconds": sum(c[3] for c in small)},
        }
