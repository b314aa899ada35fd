"""Tensor parallelism's cost on CPU, offline: `python -m loadtests.bench_engine
--tensor-parallel`.

Per model, one rank against the fewest ranks its heads split over (two for `tiny`,
three for `smollm2-135m`'s 9 heads; one thread each, so three ranks share two cores),
interleaved round by round (`--repeats`), medians: the decode step's time at each
`--concurrency` (the time of 64 decode steps less that of 8, over 56), and, with two
ranks, the share of rank 0's step spent inside collectives (the all-reduces and the
logits' all-gather, waits for the other rank included) and the cost of sending each
forward's plan (a decode step's ids, positions and attention metadata) at the
largest batch. The sampled ids need no return trip: they ride in the next plan.
"""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from replicas import Engine, EngineConfig, SamplingParams


class _Timers:
    """Seconds rank 0 spends in collectives and in sending plans (patched in)."""

    def __init__(self) -> None:
        self.collective_s = self.plan_s = 0.0
        self.num_plans = 0
        self._saved = []

    def __enter__(self):
        from replicas.tensor_parallel import rank_group

        def timed(module, name, counter):
            original = getattr(module, name)

            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    setattr(self, counter, getattr(self, counter) + time.perf_counter() - started)
                    if counter == "plan_s":
                        self.num_plans += 1
            self._saved.append((module, name, original))
            setattr(module, name, wrapper)
        timed(dist, "all_reduce", "collective_s")
        timed(dist, "all_gather", "collective_s")
        timed(rank_group, "send", "plan_s")
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)


def _decode_step_ms(engine: Engine, batch: int, timers: _Timers | None) -> dict:
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(batch)]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - started

    short = run(8)
    if timers is not None:
        timers.collective_s = timers.plan_s = 0.0
        timers.num_plans = 0
    long = run(64)
    row = {"step_ms": (long - short) / 56 * 1000}
    if timers is not None:
        row["collective_share"] = timers.collective_s / long
        row["plan_us"] = timers.plan_s / max(timers.num_plans, 1) * 1e6
    return row


def _fewest_ranks(model: str) -> int:
    """The fewest ranks above one that the model's heads split over."""
    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.model_config import ModelConfig
    from replicas.tensor_parallel.shard import rank_layout
    cfg = ModelConfig.from_dir(ensure_model_dir(model))
    for ranks in range(2, 9):
        try:
            rank_layout(cfg, 0, ranks)
            return ranks
        except ValueError:
            continue
    raise SystemExit(f"{model} splits over no tensor_parallel_size up to 8")


def report(models: list[str], batches: list[int], repeats: int) -> dict:
    rows: dict[tuple, list[dict]] = {}
    split = {model: _fewest_ranks(model) for model in models}
    for model in models:
        for _ in range(repeats):
            for ranks in (1, split[model]):
                config = EngineConfig(model=model, num_threads=1, tensor_parallel_size=ranks,
                                      max_num_seqs=max(batches), num_scheduler_steps=8)
                with Engine(config) as engine, _Timers() as timers:
                    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # warm-up
                    for batch in batches:
                        rows.setdefault((model, ranks, batch), []).append(
                            _decode_step_ms(engine, batch, timers if ranks > 1 else None))
    print(f"decode step, one thread per rank, medians of {repeats}")
    print("| model | ranks | batch | 1 rank ms | N ranks ms | N ranks / 1 | collectives' share "
          "(N) | plan us (N) |")
    print("|---|---|---|---|---|---|---|---|")
    table = {}
    for model in models:
        for batch in batches:
            one = statistics.median(r["step_ms"] for r in rows[(model, 1, batch)])
            two_rows = rows[(model, split[model], batch)]
            two = statistics.median(r["step_ms"] for r in two_rows)
            share = statistics.median(r["collective_share"] for r in two_rows)
            plan = statistics.median(r["plan_us"] for r in two_rows)
            table[f"{model} b={batch}"] = {"ranks": split[model], "one_rank_ms": one,
                                           "split_ms": two, "collective_share": share,
                                           "plan_us": plan}
            print(f"| {model} | {split[model]} | {batch} | {one:.2f} | {two:.2f} | "
                  f"{two / one:.2f} | {share:.0%} | {plan:.0f} |")
    return table
