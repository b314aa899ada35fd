"""One-shot device check: `python -m loadtests.gpu_check [--quick] [--out DIR]`.

Six parts, each time-boxed and caught on its own, the JSON rewritten after each:
  kernel_accuracy   Triton decode vs the torch backend (Llama-3-8B, Qwen shapes)
  graph_decode      CUDA-graph 8-step windows == step-by-step eager decode (greedy)
  decode_bandwidth  KV bytes read per second vs the device's measured copy bandwidth
                    and its datasheet peak
  step_profile      a Llama-3.1-8B-shaped model with random bf16 weights (built on the
                    device, no files), 256 streams decoding at once: step time for N=8
                    and N=1 windows, with the decode graphs and eager, and one window
                    under torch's profiler (GPU busy time, kernels and host operators).
  quant_decode      one decode step's linear layers of the 8B shape in bfloat16, int8 and
                    int4 (the Triton kernel) at batch 1, 16 and 256, CUDA graphs
                    (loadtests/gpu/gpu_quant_check.py)
  end_to_end        the same shape through the offline AsyncEngine, all requests sent at
                    once, N=8 per-step streaming, N=8 per-window release and N=1, on two
                    workloads: 256 streams of 128 prompt / 256 output tokens, then 1,000
                    ShareGPT-like requests (the seed's kind of run); seed-format result
                    blocks beside the JSON. It takes the time the other parts leave.
Without CUDA the GPU-only parts say "skipped: no CUDA"; `--quick` shrinks everything
(tiny shapes, 32 requests) and runs the end-to-end and profile plumbing on CPU too.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import platform
import random
import tempfile
import time
import traceback
from unittest import mock

import numpy as np
import torch

from loadtests.gpu.gpu_quant_check import check_quant_decode
from loadtests.gpu.gpu_kernel_check import (Skipped, check_decode_kernel_accuracy, measure_decode_bandwidth,
                                        require_cuda)

SEED_H100_REFERENCE = {
    "source": "seed figures: vLLM, Llama-3.1-8B, one H100, 1000 ShareGPT prompts, streaming",
    "output_tokens_per_s": 8294.0, "median_tpot_ms": 22.95, "median_itl_ms": 14.17,
}
LLAMA31_8B_SHAPE = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
QUICK_SHAPE = {**LLAMA31_8B_SHAPE, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "eos_token_id": [1]}
E2E_CONFIGS = [  # name -> EngineConfig overrides, in the order they run (the last may be cut short)
    ("N=8 per-step streaming", {"num_scheduler_steps": 8, "release_per_step": True}),
    ("N=1", {"num_scheduler_steps": 1}),
    ("N=8 per-window release", {"num_scheduler_steps": 8, "release_per_step": False}),
]
FIXED_SHAPE = (256, 128, 256)  # streams, prompt tokens, output tokens
WORKLOADS = ("fixed", "sharegpt")  # end to end, in this order
TOKENS_PER_WORD = 1.3  # the ShareGPT sample's lengths are in words; Llama-3 BPE is ~1.3 per word
PARTS = ("kernel_accuracy", "graph_decode", "decode_bandwidth", "step_profile", "quant_decode",
         "end_to_end")


def _log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the report ----------------------------------------------------------------------
class Report:
    """The JSON and the result blocks, rewritten after every part."""

    def __init__(self, out_dir: str, quick: bool, deadline: float):
        os.makedirs(out_dir, exist_ok=True)
        self.json_path = os.path.join(out_dir, "gpu_check.json")
        self.blocks_path = os.path.join(out_dir, "gpu_check_blocks.txt")
        self.deadline = deadline
        self.blocks: list[str] = []
        self.data = {"quick": quick, "environment": _environment(),
                     "seed_h100_reference": SEED_H100_REFERENCE, "parts": {}}

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn, budget_s: float) -> None:
        budget_s = max(5.0, min(budget_s, self.seconds_left()))
        _log(f"{name}: start (budget {budget_s:.0f} s)")
        start = time.monotonic()
        entry: dict = {"budget_s": budget_s}
        try:
            entry.update(status="ok", result=fn(budget_s))
        except Skipped as why:
            entry.update(status="skipped", reason=str(why))
        except Exception as error:  # noqa: BLE001 - one failure must not lose the others
            entry.update(status="error", error=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc(limit=8))
        entry["seconds"] = time.monotonic() - start
        self.data["parts"][name] = entry
        _log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s"
             + (f" ({entry.get('reason') or entry.get('error')})" if entry["status"] != "ok" else ""))
        self.write()

    def add_block(self, title: str, block: str) -> None:
        self.blocks.append(f"# {title}\n{block}")
        print(self.blocks[-1], flush=True)

    def write(self) -> None:
        with open(self.json_path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(self.blocks_path, "w") as f:
            f.write("\n\n".join(self.blocks) + ("\n" if self.blocks else ""))


def _environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available()}
    with contextlib.suppress(Exception):
        import triton
        env["triton"] = triton.__version__
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["torch_cuda"] = torch.version.cuda
    from replicas.attention.selector import why_backend_cannot_run
    env["flash_attn"] = why_backend_cannot_run(
        "flash-attn", torch.device("cuda"), torch.bfloat16, 256) or "usable"
    return env


# -- parts a and c: the kernel checks (loadtests/gpu/gpu_kernel_check.py) ----------------------
def part_kernel_accuracy(budget_s: float) -> dict:
    rows = check_decode_kernel_accuracy()
    return {"all_ok": all(r["ok"] for r in rows), "rows": rows}


# -- part b: graph-captured windows vs step-by-step eager decode --------------------------
def part_graph_decode(budget_s: float) -> dict:
    require_cuda()
    from replicas import Engine, EngineConfig, SamplingParams
    from replicas.checkpoints.random_checkpoint import write_random_checkpoint
    config = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0}
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 8192) for _ in range(rng.randrange(3, 300))] for _ in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(model_dir, config, seed=7)
        base = dict(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                    max_model_len=1024, max_num_seqs=32)
        with Engine(EngineConfig(num_scheduler_steps=8, **base)) as engine:
            graphs = engine.core.runner.decode_graphs
            if graphs is None:
                raise RuntimeError("no decode graphs were captured on CUDA with the triton backend")
            with_graphs = [o.token_ids for o in engine.generate(prompts, params)]
            num_replays, buckets = graphs.num_replays, graphs.buckets
            engine.core.runner.decode_graphs = None  # the same windows, eager
            eager_windows = [o.token_ids for o in engine.generate(prompts, params)]
        with Engine(EngineConfig(num_scheduler_steps=1, **base)) as engine:
            engine.core.runner.decode_graphs = None  # step by step, eager
            eager_steps = [o.token_ids for o in engine.generate(prompts, params)]
    return {"identical": with_graphs == eager_steps == eager_windows,
            "graph_n8_vs_eager_n1": _token_diff(with_graphs, eager_steps),
            "graph_n8_vs_eager_n8": _token_diff(with_graphs, eager_windows),
            "num_requests": len(prompts), "num_tokens": sum(map(len, eager_steps)),
            "num_graph_replays": num_replays, "buckets": buckets,
            "model": "llama 4 layers, 8/2 heads x 32, float32, random weights, triton backend"}


def _token_diff(a: list[list[int]], b: list[list[int]]) -> dict:
    mismatches = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first = None
    if mismatches:
        x, y = a[mismatches[0]], b[mismatches[0]]
        position = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        first = {"request": mismatches[0], "position": position}
    return {"identical": not mismatches, "num_mismatching_requests": len(mismatches),
            "first_mismatch": first}


# -- part d: end to end with random weights built on the device -----------------------------
def build_random_model(model_dir: str, dtype: str, device: torch.device, max_positions: int,
                       quantization: str = "none", seed: int = 0, layout=None):
    """The model for config.json in model_dir, random weights drawn in place on the device
    (no checkpoint files): matrices N(0, 0.02), norms 1. Float weights: `quantization`
    (load_model's) is none on a GPU; one rank (`layout` None: tensor_parallel_size 1)."""
    if layout is not None:
        raise ValueError("the GPU check builds one rank's model: tensor_parallel_size 1")
    from replicas.models.llama import LlamaForCausalLM
    from replicas.models.model_config import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to(getattr(torch, dtype)).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.rope.build(cfg, max_positions, torch.device(device))
    return model.eval()


def sharegpt_like_workload(num_requests: int, vocab_size: int, length_scale: float,
                           seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs with the ShareGPT sample's lengths (vLLM's
    filter: prompt 4..1024, prompt + output <= 2048), in tokens, times length_scale."""
    from loadtests.serving.datasets import MAX_PROMPT_LEN, MAX_TOTAL_LEN, sample_sharegpt_requests
    rng = np.random.default_rng(seed)
    workload = []
    for r in sample_sharegpt_requests(None, num_requests, seed=seed):
        prompt_len = min(MAX_PROMPT_LEN, round(r.prompt_len * TOKENS_PER_WORD))
        output_len = min(MAX_TOTAL_LEN - prompt_len, round(r.expected_output_len * TOKENS_PER_WORD))
        prompt_len = max(2, round(prompt_len * length_scale))
        output_len = max(2, round(output_len * length_scale))
        workload.append((rng.integers(0, vocab_size, prompt_len).tolist(), output_len))
    return workload


def fixed_workload(num_requests: int, prompt_len: int, output_len: int, vocab_size: int,
                   seed: int = 0) -> list[tuple[list[int], int]]:
    """num_requests random prompts of prompt_len ids, each asking for output_len tokens."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab_size, prompt_len).tolist(), output_len)
            for _ in range(num_requests)]


def e2e_workloads(quick: bool, num_requests: int | None, vocab_size: int,
                  kinds: tuple[str, ...] = WORKLOADS) -> dict:
    """name -> (prompt ids, output length) pairs, in the order they run."""
    streams, prompt_len, output_len = (16, 16, 32) if quick else FIXED_SHAPE
    workloads = {}
    if "fixed" in kinds:
        workloads[f"{streams} x {prompt_len}/{output_len}"] = fixed_workload(
            streams, prompt_len, output_len, vocab_size)
    if "sharegpt" in kinds:
        workloads["sharegpt-like"] = sharegpt_like_workload(
            num_requests or (32 if quick else 1000), vocab_size, 0.08 if quick else 1.0)
    return workloads


def run_e2e_config(config, workload, budget_s: float, progress_s: float) -> tuple[dict, object]:
    """One engine, all requests at once; (JSON result, BenchmarkSummary)."""
    from loadtests.engine.engine_runner import drain, greedy, stats_dict, stream_sessions
    from loadtests.gpu.gpu_step_profile import StepMix, layer_ops_in_use
    from loadtests.serving.metrics import summarize
    from replicas.async_engine import AsyncEngine
    start = time.monotonic()
    engine = AsyncEngine(config)
    try:
        startup_s = time.monotonic() - start

        async def warm() -> None:  # compiles the prefill and decode kernels once
            await asyncio.gather(*[drain(engine.generate(f"warm{i}", p[:64], greedy(12)))
                                   for i, (p, _) in enumerate(workload[:4])])
        asyncio.run(warm())
        runner = engine.core.runner
        replays0 = runner.decode_graphs.num_replays if runner.decode_graphs is not None else 0
        run_budget = max(5.0, budget_s - (time.monotonic() - start))
        sessions = [[(p, greedy(n))] for p, n in workload]
        # NOTE: after the warm-up, so that only the workload's steps count
        step_mix = StepMix(runner)
        try:
            per_session, duration, num_cut = asyncio.run(stream_sessions(
                engine.generate, sessions, budget_s=run_budget, log=_log, log_every_s=progress_s))
        finally:
            step_mix.restore()
        timelines = [t for ts in per_session for t in ts]
        graphs = runner.decode_graphs
        result = {
            "startup_s": startup_s, "attention_backend": runner.backend.name,
            "layer_ops": layer_ops_in_use(runner),
            "decode_graphs": graphs.buckets if graphs is not None else None,
            "num_graph_replays": (graphs.num_replays - replays0) if graphs is not None else 0,
            "num_requests_cut_off": num_cut,
            "all_streams_tokens_per_s": sum(t.num_output_tokens for t in timelines) / duration,
            "engine_stats": stats_dict(engine.stats()),
            "step_mix": step_mix.summary(),
        }
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summary = summarize(timelines, duration)
    result["summary"] = summary.to_dict()
    return result, summary


def part_end_to_end(report: Report, quick: bool, num_requests: int | None, budget_s: float,
                    kinds: tuple[str, ...] = WORKLOADS) -> dict:
    from loadtests.serving.metrics import format_result_block
    from replicas import EngineConfig
    on_cuda = torch.cuda.is_available()
    if not (on_cuda or quick):
        raise Skipped("skipped: no CUDA (--quick runs the plumbing on CPU)")
    shape = QUICK_SHAPE if quick else LLAMA31_8B_SHAPE
    workloads = e2e_workloads(quick, num_requests, shape["vocab_size"], kinds)
    base = dict(device="cuda" if on_cuda else "cpu", dtype="bfloat16" if on_cuda else "float32",
                max_model_len=256 if quick else 4096, max_num_seqs=16 if quick else 256,
                kv_cache_gib=0.25 if quick else 24.0, max_num_batched_tokens=512 if quick else 4096)
    results = {"model": "llama-3.1-8b shape" if not quick else "tiny llama shape",
               "shape": shape, "weights": "random, drawn on the device", "engine": base,
               "workloads": {name: {"num_requests": len(w),
                                    "total_prompt_tokens": sum(len(p) for p, _ in w),
                                    "total_output_tokens_asked": sum(n for _, n in w),
                                    "configs": {}} for name, w in workloads.items()}}
    runs = [(name, config) for name in workloads for config in E2E_CONFIGS]
    start = time.monotonic()
    # NOTE: ModelRunner builds its model with build_random_model while patched: no files.
    with tempfile.TemporaryDirectory() as model_dir, mock.patch(
            "replicas.model_runner.load_model", build_random_model):
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(shape, f, indent=1)
        for i, (workload_name, (name, overrides)) in enumerate(runs):
            left = budget_s - (time.monotonic() - start)
            config_budget = left / (len(runs) - i)
            label = f"{workload_name}, {name}"
            _log(f"end_to_end: {label} (budget {config_budget:.0f} s)")
            configs = results["workloads"][workload_name]["configs"]
            workload = workloads[workload_name]
            try:
                config = EngineConfig(model=model_dir, **base, **overrides)
                result, summary = run_e2e_config(config, workload, config_budget, 10.0)
                configs[name] = result
                report.add_block(f"end_to_end {name}: {results['model']}, {workload_name}, "
                                 f"{len(workload)} requests at once, "
                                 f"{report.data['environment'].get('device', 'cpu')}",
                                 format_result_block(summary))
            except Exception as error:  # noqa: BLE001 - the other configs still run
                configs[name] = {"status": "error", "error": f"{type(error).__name__}: {error}",
                                 "traceback": traceback.format_exc(limit=8)}
                _log(f"end_to_end: {label} failed: {error}")
            report.data["parts"]["end_to_end"] = {"status": "running", "result": results}
            report.write()
    for workload_name, entry in results["workloads"].items():
        entry["comparison"] = _compare(entry["configs"], quick or workload_name != "sharegpt-like")
    return results


def _compare(configs: dict, skip_seed: bool) -> dict:
    keys = ("output_throughput", "median_tpot_ms", "median_itl_ms")
    out = {name: {k: configs.get(name, {}).get("summary", {}).get(k) for k in keys} for name, _ in E2E_CONFIGS}
    step, window, single = (out[name] for name in
                            ("N=8 per-step streaming", "N=8 per-window release", "N=1"))
    # NOTE: each ratio where its own two medians are there and its divisor is not 0 (a
    # client that read a burst of events at once has median gaps of 0)
    if step["median_tpot_ms"] and window["median_tpot_ms"]:
        out["step_vs_window_tpot_cost"] = step["median_tpot_ms"] / window["median_tpot_ms"] - 1
    if step["median_itl_ms"] and window["median_itl_ms"] is not None:
        out["window_vs_step_median_itl_ratio"] = window["median_itl_ms"] / step["median_itl_ms"]
    if step["output_throughput"] and single["output_throughput"]:
        out["n8_step_vs_n1_throughput"] = step["output_throughput"] / single["output_throughput"]
    if step["output_throughput"] and not skip_seed:
        out["n8_step_vs_seed_h100_throughput"] = (step["output_throughput"]
                                                  / SEED_H100_REFERENCE["output_tokens_per_s"])
    return out


# -- part e: where a full-batch decode step's time goes (loadtests/gpu/gpu_step_profile.py) ---
def part_step_profile(quick: bool, budget_s: float) -> dict:
    from loadtests.gpu.gpu_step_profile import profile_windows
    on_cuda = torch.cuda.is_available()
    if not (on_cuda or quick):
        raise Skipped("skipped: no CUDA")
    shape = QUICK_SHAPE if quick else LLAMA31_8B_SHAPE
    batch, input_len = (16, 32) if quick else (256, 200)
    with tempfile.TemporaryDirectory() as model_dir, mock.patch(
            "replicas.model_runner.load_model", build_random_model):
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(shape, f, indent=1)
        windows = [profile_windows(model_dir, shape["vocab_size"], on_cuda, batch, input_len, n)
                   for n in (8, 1)]
    return {"model": "tiny llama shape" if quick else "llama-3.1-8b shape", "batch": batch,
            "input_len": input_len, "windows": windows,
            "n8_vs_n1_step_time": windows[0]["step_ms"] / windows[1]["step_ms"]}


# -- main ----------------------------------------------------------------------------------
BUDGETS_S = {"kernel_accuracy": 60, "graph_decode": 60, "decode_bandwidth": 45, "step_profile": 90,
             "quant_decode": 60, "end_to_end": 300}


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtests.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "results", help="result directory")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 32 requests")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--num-requests", type=int, default=None,
                    help="end to end, ShareGPT-like requests (1000; quick: 32)")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                    help="end to end: 256 x 128/256 tokens (fixed), ShareGPT-like, or both")
    ap.add_argument("--total-budget-s", type=float, default=380.0,
                    help="the whole run's deadline; the end-to-end part gets what the others "
                         "leave of it")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    report = Report(args.out, args.quick, time.monotonic() + args.total_budget_s)
    _log(f"device: {report.data['environment'].get('device', 'cpu (no CUDA)')}; "
         f"parts {args.parts}; writing {report.json_path}")
    fns = {"kernel_accuracy": part_kernel_accuracy, "graph_decode": part_graph_decode,
           "decode_bandwidth": lambda budget_s: measure_decode_bandwidth(),
           "end_to_end": functools.partial(part_end_to_end, report, args.quick, args.num_requests,
                                           kinds=tuple(args.workloads)),
           "step_profile": functools.partial(part_step_profile, args.quick),
           "quant_decode": lambda budget_s: check_quant_decode(args.quick)}
    for name in args.parts:
        # NOTE: the end-to-end part takes whatever time the other parts leave over.
        later = sum(BUDGETS_S[n] for n in args.parts[args.parts.index(name) + 1:])
        budget = report.seconds_left() - later if name == "end_to_end" else BUDGETS_S[name]
        report.run(name, fns[name], budget)
    _log(f"done: {report.json_path}, {report.blocks_path}")
    return report.data


if __name__ == "__main__":
    main()
