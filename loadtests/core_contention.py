"""What work on another core does to a one-thread engine step on this one:
`python -m loadtests.bench_engine --contention`.

A served CPU engine replica is one torch thread on one core; the HTTP side (ingress,
front door, Ray, a benchmark client) and, with one replica per core, a second engine
run on the others. When a change to the HTTP side makes the engine's CPU per token
rise, either the engine does more work of its own or its step runs slower because of
what runs beside it. This tells the two apart: it times the model's decode-step
matrix products (loadtests/gemm_roofline.py's `step_products`, float32, one thread)
pinned to one core, alone and beside a neighbour pinned to another core. Each use of
a product has weights of its own, as each layer does, so the step reads the model's
whole weight bytes from memory as the real one does:

- `python`: the interpreter's own work, JSON in and out (what the HTTP side does);
- `gemm step`: the same step's products (a second engine replica);
- `memory copy`: a 64 MiB copy, over and over (the memory bus and last-level cache).

Rows are interleaved round by round (a noisy machine); medians. Needs two usable
cores (Linux CPU affinity).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NEIGHBOURS = ("python", "gemm step", "memory copy")
COPY_BYTES = 64 * 1024 * 1024


def usable_core_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def _products_of(config) -> list[tuple[int, int, int]]:
    from loadtests.gemm_roofline import step_products

    return [(k, n, count) for _, k, n, count in step_products(config)]


def _step_runner(products: list[tuple[int, int, int]], batch: int):
    """A callable doing one step's products on this thread: `count` of each, each with
    weights of its own (one per layer). NOTE: sets torch's threads to 1 in this
    process; `measure` puts them back."""
    import torch

    torch.set_num_threads(1)
    pairs = [(torch.randn(batch, k), torch.randn(k, n)) for k, n, count in products for _ in range(count)]

    def step() -> None:
        for x, w in pairs:
            torch.mm(x, w)
    return step


def steps_per_second(step, seconds: float, min_steps: int = 8) -> float:
    """`step()`s a second over at least `seconds` and `min_steps` steps."""
    step()  # warm: caches, after the neighbour's start
    done, start = 0, time.perf_counter()
    while True:
        step()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and done >= min_steps:
            return done / elapsed


def _neighbour_work(kind: str, products: list, batch: int):
    """The neighbour's unit of work, set up (allocations done) before it is returned."""
    if kind == "python":
        doc = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x" * 24, "finish_reason": None}]}
        return lambda: json.loads(json.dumps(doc))
    if kind == "gemm step":
        return _step_runner(products, batch)
    if kind == "memory copy":
        import torch

        torch.set_num_threads(1)
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    raise ValueError(f"neighbour must be one of {NEIGHBOURS}, got {kind!r}")


# NOTE: started with -c, not as a module of its own: loadtests keeps its six entry points.
_NEIGHBOUR = "import sys; from loadtests.core_contention import neighbour_main; neighbour_main(sys.argv[1:])"


def neighbour_command(kind: str, core: int, products: list, batch: int) -> list[str]:
    return [sys.executable, "-c", _NEIGHBOUR, "--neighbour", kind, "--core", str(core),
            "--products", json.dumps(products), "--batch", str(batch)]


def start_neighbour(kind: str, core: int, products: list, batch: int) -> subprocess.Popen:
    """A process of `kind` pinned to `core`, working until killed (or until this
    process dies: it watches its stdin); returned once it has set up and done its
    work once (its start-up is not its work)."""
    proc = subprocess.Popen(neighbour_command(kind, core, products, batch),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        line = proc.stdout.readline().strip()
        if line != b"working":
            raise RuntimeError(f"the {kind!r} neighbour exited before it worked ({proc.wait()})")
    except BaseException:
        stop_neighbour(proc)
        raise
    return proc


def stop_neighbour(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        pipe.close()


def measure(products: list[tuple[int, int, int]], batch: int, rounds: int = 3,
            seconds: float = 3.0) -> dict[str, dict]:
    """{row: {"steps_per_s", "x_alone", "rounds"}}: the step on the first usable core,
    alone and beside each neighbour on the second, interleaved round by round."""
    cores = usable_core_ids()
    if len(cores) < 2:
        raise SystemExit(f"--contention needs two usable cores (Linux CPU affinity); this "
                         f"process may use {len(cores) or 'an unknown number of'}")
    import torch

    mine, theirs = cores[0], cores[1]
    before, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {mine})
    samples: dict[str, list[float]] = {"alone": [], **{kind: [] for kind in NEIGHBOURS}}
    try:
        step = _step_runner(products, batch)  # weights made once, on this core, for every sample
        for _ in range(rounds):
            for row in samples:
                neighbour = None if row == "alone" else start_neighbour(row, theirs, products, batch)
                try:
                    samples[row].append(steps_per_second(step, seconds))
                    if neighbour is not None and neighbour.poll() is not None:
                        raise RuntimeError(f"the {row!r} neighbour exited ({neighbour.returncode})")
                finally:
                    if neighbour is not None:
                        stop_neighbour(neighbour)
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads_before)
    alone = statistics.median(samples["alone"])
    return {row: {"steps_per_s": statistics.median(v), "x_alone": statistics.median(v) / alone,
                  "rounds": v} for row, v in samples.items()}


def report(models: list[str], batches: list[int], rounds: int) -> dict:
    from loadtests.metrics import format_table
    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.model_config import ModelConfig

    result = {}
    for model in models:
        products = _products_of(ModelConfig.from_dir(ensure_model_dir(model)))
        for batch in batches:
            rows = measure(products, batch, rounds)
            result[f"{model}, {batch} streams"] = rows
            print(f"\n{model}: one decode step's matrix products, float32, {batch} streams, one "
                  f"thread on one core; beside a neighbour on another core (medians of {rounds})")
            print(format_table(rows, [("steps_per_s", "steps/s", ".1f"),
                                      ("x_alone", "x alone", ".2f")], name_header="beside"),
                  flush=True)
    return result


def _exit_when_the_parent_goes() -> None:
    """A neighbour busy-loops on a pinned core: once its parent is gone (its stdin
    closes, whatever ended the parent) it must not go on."""
    import threading

    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def neighbour_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="loadtests.core_contention neighbour",
                                description="A neighbour for --contention (not for direct use).")
    p.add_argument("--neighbour", choices=NEIGHBOURS, required=True)
    p.add_argument("--core", type=int, required=True)
    p.add_argument("--products", required=True, help="JSON [[in, out, count], ...]")
    p.add_argument("--batch", type=int, required=True)
    args = p.parse_args(argv)
    _exit_when_the_parent_goes()
    os.sched_setaffinity(0, {args.core})
    work = _neighbour_work(args.neighbour, [tuple(x) for x in json.loads(args.products)], args.batch)
    work()
    print("working", flush=True)
    while True:
        work()

