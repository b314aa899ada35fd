"""How far the engine runs below the model's own forward pass, and where the rest goes:
`python -m loadtests.bench_engine --ceiling` (loadtests/README.md).

On one workload: the **ceiling** (the raw forward of our model over the same work,
inputs built beforehand: no scheduler, sampler or output), the **engine** (the full
AsyncEngine through loadtests/engine/engine_runner.py), optionally the **baseline** (the
engine of another git revision under this revision's harness, interleaved), and the
**breakdown** (one engine run under torch.profiler, its step split into phases).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from loadtests.engine.engine_runner import engine_config, greedy, random_prompts, run_engine, sessions_of
from loadtests.serving.metrics import format_table, median_rows
from replicas import EngineConfig, SamplingParams
from replicas.request import Request
from replicas.scheduler import ScheduledSeq, SchedulerOutput

REPO_ROOT = Path(__file__).resolve().parents[2]


class _NullSink:
    def put(self, delta, notify=True, wakes=None) -> None:
        pass

    def notify(self) -> None:
        pass


# -- the ceiling ----------------------------------------------------------------
def raw_forward(config: EngineConfig, num_seqs: int, input_len: int, output_len: int) -> dict:
    """Times the model's forward alone over the workload; see the module docstring."""
    from replicas.kv_cache.block_manager import BlockManager
    from replicas.checkpoints.dtype_choice import resolve_dtype
    from replicas.model_runner import ModelRunner
    from replicas.models.model_config import ModelConfig
    from replicas.checkpoints.presets import ensure_model_dir

    model_dir = ensure_model_dir(config.model)
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device, model_dir)[0])
    max_len = config.max_model_len or ModelConfig.from_dir(model_dir).max_position_embeddings
    runner = ModelRunner(config, model_dir, max_len)
    bm = BlockManager(runner.num_blocks, config.block_size, enable_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, _NullSink(), frozenset(), output_len)
            for i, p in enumerate(random_prompts(num_seqs, input_len))]

    def grow(req: Request, num_tokens: int) -> None:
        bm.allocate(req.block_ids, num_tokens)

    # prefill chunks, as the scheduler packs them (whole prompts up to the budget)
    prefill_inputs, chunk = [], []
    budget = config.max_num_batched_tokens
    for req in reqs:
        if chunk and sum(len(r.prompt_token_ids) for r in chunk) + input_len > budget:
            prefill_inputs.append(chunk)
            chunk = []
        chunk.append(req)
    prefill_inputs.append(chunk)
    built = []
    for chunk in prefill_inputs:
        for r in chunk:
            grow(r, input_len)
        built.append(runner.prepare_inputs(SchedulerOutput(
            prefill_seqs=[ScheduledSeq(r, 0, input_len, True) for r in chunk])))
        for r in chunk:
            r.num_computed_tokens = input_len
            r.output_token_ids.append(r.prompt_token_ids[-1])
    num_prefill = len(built)
    for step in range(output_len - 1):  # the first token comes from the prefill
        for r in reqs:
            grow(r, r.num_computed_tokens + 1)
        built.append(runner.prepare_inputs(SchedulerOutput(
            decode_seqs=[ScheduledSeq(r, r.num_computed_tokens, 1, True) for r in reqs])))
        for r in reqs:
            r.num_computed_tokens += 1
            r.output_token_ids.append(r.output_token_ids[-1])
    times = []
    with torch.inference_mode():
        for inputs in built[:2]:  # warm-up, same shapes
            runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                         runner.backend, inputs.logits_indices)
        for inputs in built:
            t0 = time.perf_counter()
            runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                         runner.backend, inputs.logits_indices)
            times.append(time.perf_counter() - t0)
    prefill_s, decode_s = sum(times[:num_prefill]), sum(times[num_prefill:])
    total_tokens = num_seqs * output_len
    return {"output_throughput": total_tokens / (prefill_s + decode_s),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_only_tokens_per_s": num_seqs * (output_len - 1) / decode_s,
            "backend": runner.backend.name, "dtype": config.dtype}


# -- the engine, here and at a baseline revision ------------------------------------
# NOTE: the tree's `replicas` and `deltas` are imported first, then this revision's
# harness (loadtests) is put in front: one harness measures both engines.
_IN_TREE = ("import json, sys; sys.path[:0] = [sys.argv[1]]; import replicas, deltas; "
            "sys.path[:0] = [sys.argv[2]]; from loadtests.engine import engine_ceiling as c; "
            "print('RESULT ' + json.dumps(getattr(c, sys.argv[3])(*json.loads(sys.argv[4]))))")


def in_tree(tree: Path, function: str, *args) -> dict:
    """`function(*args)` of this module over the engine of the source tree `tree`, in a
    fresh interpreter (the same conditions for the working tree and a baseline)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _IN_TREE, str(tree), str(REPO_ROOT), function,
                           json.dumps(args)], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{function} in {tree} failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def engine_row(model: str, num_seqs: int, input_len: int, output_len: int) -> dict:
    return run_engine(engine_config(model), sessions_of(random_prompts(num_seqs, input_len),
                                                         greedy(output_len)))


@contextlib.contextmanager
def source_tree_at(ref: str):
    """The repository's files at git revision `ref`, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="stepstream-baseline-") as tmp:
        archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=REPO_ROOT,
                                 capture_output=True, check=True).stdout
        archive_path = Path(tmp) / "src.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(Path(tmp) / "tree", filter="data")
        yield Path(tmp) / "tree"


def compare_with_baseline(workload: tuple, baseline_ref: str | None, repeats: int,
                          current_ref: str | None = None) -> dict:
    """Engine rows of the working tree (or `current_ref`) and of `baseline_ref`,
    interleaved round by round (a noisy machine), medians."""
    with contextlib.ExitStack() as stack:
        trees = {"current": stack.enter_context(source_tree_at(current_ref)) if current_ref else REPO_ROOT}
        if baseline_ref:
            trees["baseline"] = stack.enter_context(source_tree_at(baseline_ref))
        rounds = [{name: in_tree(tree, "engine_row", *workload) for name, tree in trees.items()}
                  for _ in range(repeats)]
    return median_rows(rounds)


# -- the breakdown --------------------------------------------------------------------
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")
PHASES = ("schedule", "inputs", "attention", "matmuls", "other model ops", "sampling",
          "host sync", "output flush wait", "loop (python, bookkeeping)")


def _labelled(fn, label: str):
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def profile_breakdown(model: str, num_seqs: int, input_len: int, output_len: int,
                      trace_path: str) -> dict:
    """One offline engine run (the loop in this thread) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    from replicas import Engine
    from replicas import model_runner as mr

    engine = Engine(engine_config(model))
    core, runner = engine.core, engine.core.runner
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))  # warm-up
    # NOTE: labels by wrapping, so the product code carries no profiling hooks
    core.scheduler.schedule = _labelled(core.scheduler.schedule, "phase:schedule")
    core.output.wait = _labelled(core.output.wait, "phase:output flush wait")
    runner.prepare_inputs = _labelled(runner.prepare_inputs, "phase:inputs")
    runner.model.forward = _labelled(runner.model.forward, "phase:model")
    runner.backend.forward = _labelled(runner.backend.forward, "phase:attention")
    runner.backend.store_kv = _labelled(runner.backend.store_kv, "phase:attention")
    runner._host_sync = _labelled(runner._host_sync, "phase:host sync")
    saved = mr.sample_no_sync, mr.build_sampling_batch
    mr.sample_no_sync = _labelled(mr.sample_no_sync, "phase:sampling")
    mr.build_sampling_batch = _labelled(mr.build_sampling_batch, "phase:inputs")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    cpu0 = core.output.cpu_time_s
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            engine.generate(random_prompts(num_seqs, input_len), params)
            wall = time.perf_counter() - t0
    finally:
        mr.sample_no_sync, mr.build_sampling_batch = saved
        output_cpu = core.output.cpu_time_s - cpu0
        engine.shutdown()
    prof.export_chrome_trace(trace_path)
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        key = evt.key
        if key.startswith("phase:"):
            totals[key[6:]] = totals.get(key[6:], 0.0) + evt.cpu_time_total / 1e6
        elif key in MATMUL_OPS:
            totals["matmuls"] = totals.get("matmuls", 0.0) + evt.self_cpu_time_total / 1e6
    model = totals.pop("model", 0.0)
    totals["other model ops"] = max(0.0, model - totals.get("attention", 0.0) - totals.get("matmuls", 0.0))
    totals["loop (python, bookkeeping)"] = max(0.0, wall - sum(totals.values()))
    return {"wall_s": wall, "phases_s": {p: totals.get(p, 0.0) for p in PHASES},
            "output_processing_cpu_s": output_cpu, "trace": trace_path,
            "backend": runner.backend.name}


def print_report(result: dict) -> None:
    """The ceiling (when measured), the engine (at --current-ref when given), the
    baseline and the step breakdown."""
    c, e, w = result.get("ceiling"), result["engine"], result["workload"]
    print(f"\n{w['model']}, {w['num_seqs']} streams, {w['input_len']} in / {w['output_len']} out"
          + (f" ({c['backend']} attention, {c['dtype']})" if c else ""))
    cur = e["current"]
    rounds = f"(rounds {[round(x) for x in cur['rounds_output_throughput']]})"
    if c:
        print(f"  ceiling (raw forward):  {c['output_throughput']:8.0f} tok/s "
              f"(prefill {c['prefill_s']:.2f} s, decode {c['decode_s']:.2f} s; decode alone "
              f"{c['decode_only_tokens_per_s']:.0f} tok/s)")
        rounds = (f"= {cur['output_throughput'] / c['output_throughput']:.0%} of the ceiling, "
                  f"{cur['output_throughput'] / c['decode_only_tokens_per_s']:.0%} of decode alone")
    engine = f"engine at {result['current_ref']}:" if result.get("current_ref") else "engine:"
    print(f"  {engine:<23} {cur['output_throughput']:8.0f} tok/s {rounds}")
    if "baseline" in e:
        base = e["baseline"]
        print(f"  {'engine at ' + result['baseline_ref'] + ':':<23} {base['output_throughput']:8.0f} tok/s "
              f"-> {cur['output_throughput'] / base['output_throughput']:.2f}x now "
              f"(rounds: now {[round(x) for x in cur['rounds_output_throughput']]}, "
              f"then {[round(x) for x in base['rounds_output_throughput']]})")
    b, base = result.get("breakdown"), result.get("baseline_breakdown")
    if b:
        rows = {}
        for phase in [*b["phases_s"], "wall"]:
            now = b["wall_s"] if phase == "wall" else b["phases_s"][phase]
            rows[phase] = {"now": now, "now_share": now / b["wall_s"]}
            if base:
                then = base["wall_s"] if phase == "wall" else base["phases_s"].get(phase, 0.0)
                rows[phase].update(then=then, then_share=then / base["wall_s"])
        columns = [("now", "now s", ".2f"), ("now_share", "share", ".1%")]
        columns += [("then", f"at {result['baseline_ref']} s", ".2f"), ("then_share", "share", ".1%")] if base else []
        print("engine step breakdown (offline engine under the profiler; seconds, share of wall):\n"
              + format_table(rows, columns, name_header="phase"))
        print(f"output processing (its own thread): {b['output_processing_cpu_s']:.2f} s CPU; trace: "
              f"{b['trace']}" + (f" (baseline: {base['trace']})" if base else ""))


def ceiling_run(model: str, num_seqs: int, args) -> dict:
    """`--ceiling` for one model and stream count (args: bench_engine's flags)."""
    output_len = args.output_len
    if num_seqs > 256:
        raise SystemExit("--ceiling decodes every stream in one batch, and the engine runs at "
                         "most max_num_seqs=256 at once: use --concurrency <= 256")
    workload = (model, num_seqs, args.input_len, output_len)
    result = {"workload": dict(zip(("model", "num_seqs", "input_len", "output_len"), workload)),
              "baseline_ref": args.baseline_ref}
    result["engine"] = compare_with_baseline(workload, args.baseline_ref, args.repeats, args.current_ref)
    if args.current_ref:  # two revisions' engines only: the rest measures the working tree
        result["current_ref"] = args.current_ref
        print_report(result)
        return result
    result["ceiling"] = raw_forward(engine_config(model), *workload[1:])
    trace = os.path.join(args.result_dir, f"engine_trace_{model}_{num_seqs}.json")
    result["breakdown"] = profile_breakdown(*workload, trace)
    if args.baseline_ref:
        with source_tree_at(args.baseline_ref) as tree:
            result["baseline_breakdown"] = in_tree(tree, "profile_breakdown", *workload, os.path.abspath(
                os.path.join(args.result_dir, f"engine_trace_{model}_{num_seqs}_baseline.json")))
    print_report(result)
    return result
