"""Offline, in-process engine benchmark (no HTTP): `python -m loadtests.bench_engine`.

Default: the `tiny` and `small` presets at 1, 16 and 64 concurrent requests
(128 prompt / 128 output tokens, ignore_eos, greedy), beside transformers'
`generate` on the same workload (one request at a time, and one batch), with
ratios. `--matrix`: N=1 vs N=8, async off vs on, release per step vs per window
vs no streaming, at 64 and 256 concurrent streams (128 in / 256 out); plus the
output-processing CPU time per token at output lengths 128 and 2048.

Timings are taken where a consumer sees them: TTFT at the first delta, ITL per
delta received (as vLLM's benchmark measures per chunk), TPOT per request.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import time

import numpy as np

from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncEngine
from deltas.types import OutputKind


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 8192) for _ in range(length)] for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _stream(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams,
                  sem: asyncio.Semaphore) -> dict:
    async with sem:
        start = time.perf_counter()
        times, n = [], 0
        async for delta in engine.generate(rid, prompt, params):
            if delta.token_ids:
                times.append(time.perf_counter())
                n += len(delta.token_ids)
        return {"start": start, "chunk_times": times, "num_tokens": n}


def run_engine(config: EngineConfig, num_requests: int, concurrency: int, input_len: int,
               output_len: int, kind: OutputKind = OutputKind.DELTA,
               temperature: float = 0.0) -> dict:
    """Run one configuration and summarise it the way benchmark_serving does.
    `temperature` 0 is greedy; OpenAI clients that send none get 1.0."""
    engine = AsyncEngine(config)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True,
                            output_kind=kind)
    prompts = _prompts(num_requests, input_len, seed=1)
    try:
        async def warm():
            async for _ in engine.generate("warmup", prompts[0][:8], SamplingParams(max_tokens=4)):
                pass

        async def main():
            sem = asyncio.Semaphore(concurrency)
            return await asyncio.gather(*[_stream(engine, f"r{i}", p, params, sem)
                                          for i, p in enumerate(prompts)])
        asyncio.run(warm())
        cpu0 = engine.core.output.cpu_time_s
        tokens0 = engine.core.output.num_output_tokens
        t0 = time.perf_counter()
        records = asyncio.run(main())
        duration = time.perf_counter() - t0
        out_cpu = engine.core.output.cpu_time_s - cpu0
        out_tokens = engine.core.output.num_output_tokens - tokens0
    finally:
        engine.shutdown()
        gc.collect()
    ttft, tpot, itl, chunk_sizes, latency = [], [], [], [], []
    total = 0
    for r in records:
        t = r["chunk_times"]
        total += r["num_tokens"]
        ttft.append((t[0] - r["start"]) * 1e3)
        latency.append((t[-1] - r["start"]) * 1e3)
        if r["num_tokens"] > 1 and len(t) > 1:  # a single delta (no streaming) has no TPOT
            tpot.append((t[-1] - t[0]) * 1e3 / (r["num_tokens"] - 1))
        itl += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
        chunk_sizes.append(r["num_tokens"] / len(t))
    return {
        "output_tokens_per_s": total / duration, "duration_s": duration, "num_output_tokens": total,
        "median_ttft_ms": _pct(ttft, 50), "median_latency_ms": _pct(latency, 50), "median_tpot_ms": _pct(tpot, 50), "p99_tpot_ms": _pct(tpot, 99),
        "median_itl_ms": _pct(itl, 50), "p99_itl_ms": _pct(itl, 99),
        "mean_tokens_per_delta": statistics.fmean(chunk_sizes),
        "output_cpu_us_per_token": out_cpu * 1e6 / max(out_tokens, 1),
    }


def run_transformers(model_dir: str, batch: int, num_requests: int, input_len: int, output_len: int) -> dict:
    """transformers' greedy generate on the same workload, `batch` prompts at a time."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts = _prompts(num_requests, input_len, seed=1)
    tpot, total = [], 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, num_requests, batch):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding needed
            s = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=4)
            elapsed = time.perf_counter() - s
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
            tpot.append(elapsed * 1e3 / output_len)
    duration = time.perf_counter() - t0
    return {"output_tokens_per_s": total / duration, "median_tpot_ms": statistics.median(tpot)}


def _cfg(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, max_num_seqs=max(256, kw.pop("max_num_seqs", 256)), **kw)


def core_table(models: list[str], concurrencies: list[int], hf_batch_max: int) -> list[dict]:
    from replicas.presets import ensure_model_dir
    rows = []
    for model in models:
        model_dir = ensure_model_dir(model)
        hf_single = run_transformers(model_dir, 1, 2, 128, 128)
        for c in concurrencies:
            n = max(c, 4)
            ours = run_engine(_cfg(model), n, c, 128, 128)
            hf_batch = run_transformers(model_dir, min(c, hf_batch_max), min(c, hf_batch_max), 128, 128) \
                if c > 1 else hf_single
            rows.append({"model": model, "concurrency": c, "engine": ours, "hf_one_at_a_time": hf_single,
                         "hf_batched": hf_batch,
                         "speedup_vs_hf_single": ours["output_tokens_per_s"] / hf_single["output_tokens_per_s"],
                         "speedup_vs_hf_batched": ours["output_tokens_per_s"] / hf_batch["output_tokens_per_s"]})
            _print_core_row(rows[-1])
    return rows


MATRIX = {  # name -> (EngineConfig overrides, output kind)
    "N1-sync": (dict(num_scheduler_steps=1, async_output=False), OutputKind.DELTA),
    "N1-async": (dict(num_scheduler_steps=1, async_output=True), OutputKind.DELTA),
    "N8-sync-step": (dict(num_scheduler_steps=8, async_output=False), OutputKind.DELTA),
    "N8-async-window": (dict(num_scheduler_steps=8, release_per_step=False), OutputKind.DELTA),
    "N8-async-step": (dict(num_scheduler_steps=8), OutputKind.DELTA),
    "N8-async-nostream": (dict(num_scheduler_steps=8), OutputKind.FINAL_ONLY),
}


def matrix_table(models: list[str], concurrencies: list[int], output_len: int, repeats: int) -> list[dict]:
    rows = []
    for model in models:
        for c in concurrencies:
            # NOTE: configurations interleaved, `repeats` rounds, medians: noisy machine
            runs: dict[str, list[dict]] = {name: [] for name in MATRIX}
            for _ in range(repeats):
                for name, (over, kind) in MATRIX.items():
                    runs[name].append(run_engine(_cfg(model, **over), c, c, 128, output_len, kind))
            for name, rs in runs.items():
                row = {"model": model, "concurrency": c, "config": name,
                       **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
                rows.append(row)
            _print_matrix(rows[-len(MATRIX):])
    return rows


def output_cost_table(model: str, lengths: list[int]) -> list[dict]:
    rows = []
    for n in lengths:
        r = run_engine(_cfg(model, num_scheduler_steps=8, max_model_len=max(lengths) + 64), 16, 16, 16, n)
        rows.append({"output_len": n, "output_cpu_us_per_token": r["output_cpu_us_per_token"]})
    base = rows[0]["output_cpu_us_per_token"]
    print("\nOutput processing CPU time per token (tiny, N=8, 16 streams)")
    for r in rows:
        r["ratio_vs_first"] = r["output_cpu_us_per_token"] / base
        print(f"  output_len {r['output_len']:>5}: {r['output_cpu_us_per_token']:.2f} us/token "
              f"({r['ratio_vs_first']:.2f}x)")
    return rows


def _print_core_row(r: dict) -> None:
    e, s, b = r["engine"], r["hf_one_at_a_time"], r["hf_batched"]
    print(f"{r['model']:<6} c={r['concurrency']:<3} engine {e['output_tokens_per_s']:8.0f} tok/s "
          f"TPOT {e['median_tpot_ms']:6.1f} ms | HF single {s['output_tokens_per_s']:7.0f} tok/s "
          f"| HF batch {b['output_tokens_per_s']:7.0f} tok/s | x{r['speedup_vs_hf_single']:.1f} single, "
          f"x{r['speedup_vs_hf_batched']:.2f} batched", flush=True)


def _print_matrix(rows: list[dict]) -> None:
    base = {r["config"]: r for r in rows}
    print(f"\n{rows[0]['model']}, {rows[0]['concurrency']} streams")
    print(f"{'config':<18}{'tok/s':>8}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'tok/delta':>10}"
          f"{'x tok/s vs N1-sync':>20}")
    for r in rows:
        ratio = r["output_tokens_per_s"] / base["N1-sync"]["output_tokens_per_s"]
        print(f"{r['config']:<18}{r['output_tokens_per_s']:8.0f}{r['median_tpot_ms']:10.2f}"
              f"{r['p99_tpot_ms']:8.2f}{r['median_itl_ms']:9.2f}{r['p99_itl_ms']:8.2f}"
              f"{r['mean_tokens_per_delta']:10.2f}{ratio:20.2f}")
    step, window = base["N8-async-step"], base["N8-async-window"]
    print(f"per-step vs per-window: TPOT cost {100 * (step['median_tpot_ms'] / window['median_tpot_ms'] - 1):+.1f}%"
          f", median ITL {window['median_itl_ms'] / step['median_itl_ms']:.1f}x better; "
          f"N8-async-step vs N1-sync throughput {step['output_tokens_per_s'] / base['N1-sync']['output_tokens_per_s']:.2f}x",
          flush=True)


def ceiling_run(model: str, num_seqs: int, args) -> dict:
    from loadtests import bench_ceiling as bc
    output_len = args.output_len or 128
    if num_seqs > 256:
        raise SystemExit("--ceiling decodes every stream in one batch, and the engine runs at "
                         "most max_num_seqs=256 at once: use --concurrency <= 256")
    config = _cfg(model)
    result = {"workload": {"model": model, "num_seqs": num_seqs, "input_len": args.input_len,
                           "output_len": output_len}, "baseline_ref": args.baseline_ref}
    result["engine"] = bc.compare_with_baseline(model, num_seqs, args.input_len, output_len,
                                                args.baseline_ref, args.repeats, args.current_ref)
    if args.current_ref:  # two revisions' engines only: the rest measures the working tree
        cur, base = result["engine"]["current"], result["engine"].get("baseline")
        print(f"\n{model}, {num_seqs} streams: engine at {args.current_ref} "
              f"{cur['output_tokens_per_s']:.0f} tok/s (rounds {[round(x) for x in cur['runs_tokens_per_s']]})"
              + (f", at {args.baseline_ref} {base['output_tokens_per_s']:.0f} tok/s (rounds "
                 f"{[round(x) for x in base['runs_tokens_per_s']]}): "
                 f"{cur['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x" if base else ""))
        return result
    result["ceiling"] = bc.raw_forward(config, num_seqs, args.input_len, output_len)
    trace = os.path.join(args.result_dir, f"engine_trace_{model}_{num_seqs}.json")
    result["breakdown"] = bc.profile_breakdown(config, num_seqs, args.input_len, output_len, trace)
    if args.baseline_ref:
        with bc.source_tree_at(args.baseline_ref) as tree:
            result["baseline_breakdown"] = bc.breakdown_in_subprocess(
                tree, model, num_seqs, args.input_len, output_len,
                os.path.join(args.result_dir, f"engine_trace_{model}_{num_seqs}_baseline.json"))
    bc.print_report(result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", action="store_true", help="the multi-step/async/streaming matrix")
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--output-len", type=int, default=None,
                    help="output length: --matrix 256, --ceiling 128 unless given")
    ap.add_argument("--repeats", type=int, default=1, help="matrix / ceiling rounds (medians)")
    ap.add_argument("--hf-batch-max", type=int, default=64)
    ap.add_argument("--result-dir", default="results")
    ap.add_argument("--ceiling", action="store_true",
                    help="raw forward vs the engine on one workload, with a profiled step "
                         "breakdown (loadtests/bench_ceiling.py); defaults: tiny, 200 streams")
    ap.add_argument("--baseline-ref", default=None,
                    help="with --ceiling: also run the engine at this git revision, interleaved")
    ap.add_argument("--current-ref", default=None,
                    help="with --ceiling: compare only the engines of this revision and --baseline-ref")
    ap.add_argument("--input-len", type=int, default=128)
    args = ap.parse_args()
    os.makedirs(args.result_dir, exist_ok=True)
    if args.ceiling:
        models = args.models if args.models != ["tiny", "small"] else ["tiny"]
        result = {"ceiling": [ceiling_run(m, c, args) for m in models
                              for c in (args.concurrency or [200])]}
        path = os.path.join(args.result_dir, "bench_engine_ceiling.json")
    elif args.matrix:
        conc = args.concurrency or [64, 256]
        result = {"matrix": matrix_table(args.models, conc, args.output_len or 256, args.repeats),
                  "output_cost": output_cost_table("tiny", [128, 2048])}
        path = os.path.join(args.result_dir, "bench_engine_matrix.json")
    else:
        result = {"core": core_table(args.models, args.concurrency or [1, 16, 64], args.hf_batch_max)}
        path = os.path.join(args.result_dir, "bench_engine.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
