"""`python -m loadtests.bench_engine --sampling`: sampling over a trained model's
vocabulary against greedy.

Two tables, side by side in one run:
- the sampler alone, ms per step on (streams x vocabulary) random logits: greedy,
  temperature 1.0, and temperature 1.0 with top-k 50 and top-p 0.9 from each row's top
  candidates (the CPU path) and by the whole-vocabulary sort (the path before it, a
  GPU's);
- the offline engine's output tok/s at those settings on the model, as a ratio to greedy.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from loadtests.engine.engine_runner import engine_config, greedy, random_prompts, run_engine, sessions_of
from loadtests.serving.metrics import format_table, median_rows

SETTINGS = {"greedy": dict(temperature=0.0), "t=1": dict(temperature=1.0),
            "t=1 top-k 50 top-p 0.9": dict(temperature=1.0, top_k=50, top_p=0.9)}
SORTED = "t=1 top-k 50 top-p 0.9, whole-vocabulary sort"


def _sampler_ms(vocab: int, batch: int, samples: int = 7) -> dict[str, float]:
    from replicas.config import SamplingParams
    from replicas.request import Request
    from replicas.sampling.sampler import build_sampling_batch, sample_no_sync

    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1)) * 3
    out = {}
    for name, kw in [*SETTINGS.items(), (SORTED, SETTINGS["t=1 top-k 50 top-p 0.9"])]:
        rows = [Request(f"r{i}", [1], SamplingParams(max_tokens=8, **kw), None, frozenset(), 8)
                for i in range(batch)]
        sb = build_sampling_batch(rows, vocab, torch.device("cpu"))
        if name == SORTED:
            sb = dataclasses.replace(sb, candidates=None)
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            sample_no_sync(logits, sb)[1].tolist()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def report(models: list[str], concurrency: list[int], input_len: int, output_len: int,
           repeats: int) -> dict:
    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.model_config import ModelConfig

    result = {}
    for model in models:
        vocab = ModelConfig.from_dir(ensure_model_dir(model)).vocab_size
        sampler_rows = {f"{c} streams": _sampler_ms(vocab, c) for c in concurrency}
        print(f"\n{model}: the sampler alone, ms per step, {vocab:,} vocabulary (medians of 7)")
        print(format_table(sampler_rows, [(n, n, ".1f") for n in [*SETTINGS, SORTED]]), flush=True)
        engine_rows = {}
        for c in concurrency:
            rounds = []
            for _ in range(repeats):
                rounds.append({name: run_engine(engine_config(model), sessions_of(
                    random_prompts(c, input_len), greedy(output_len, **kw)), c)
                    for name, kw in SETTINGS.items()})
            rows = median_rows(rounds)
            for name, row in rows.items():
                row["x_greedy"] = row["output_throughput"] / rows["greedy"]["output_throughput"]
            engine_rows[f"{c} streams"] = rows
            print(f"\n{model}, {c} streams, {input_len} in / {output_len} out, ignore_eos; "
                  f"medians of {repeats} interleaved rounds")
            print(format_table(rows, [("output_throughput", "tok/s", ".0f"),
                                      ("median_tpot_ms", "TPOT p50 ms", ".1f"),
                                      ("x_greedy", "x greedy", ".2f")], name_header="sampling"),
                  flush=True)
        result[model] = {"sampler_ms": sampler_rows, "engine": engine_rows}
    return result
