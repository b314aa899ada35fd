"""Where each path of the quantized layers is fastest, measured in the engine (the
weights come from memory there, as they do when serving; a layer timed alone
sits in the cache and favours the float paths).

For each decode batch size, the offline engine decodes that many greedy streams
with every quantized layer on one path (loadtests/engine/quant_accuracy.py's
`route_rows`: the integer kernel, the batch kernel, the dequantized GEMM), all
paths side by side in one run; `--quantization none` beside them.

    python -m loadtests.bench_engine --paths --concurrency 1 4 8 16 32 64

Prints decode tok/s per batch size and path; the fastest path per row is what
replicas/quant/linear.py's KERNEL_MAX_ROWS and GEMM_MAX_ROWS should pick.
"""
from __future__ import annotations

import time

import torch

from loadtests.engine.quant_accuracy import PATHS, route_rows

PROMPT_LEN = 16
NEW_TOKENS = 48


def decode_tok_s(engine, batch: int) -> float:
    """Output tok/s of `batch` streams of NEW_TOKENS after a short prompt each."""
    from replicas import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)] for i in range(batch)]
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm
    start = time.perf_counter()
    engine.generate(prompts, params)
    return batch * NEW_TOKENS / (time.perf_counter() - start)


def report(model: str, batches: list[int], threads: int = 1, dtype: str = "auto") -> dict:
    """Print decode tok/s per batch size and path, `none` beside; return the rows."""
    from replicas import Engine, EngineConfig

    common = dict(model=model, dtype=dtype, num_threads=threads, use_idle_cores=False,
                  enable_prefix_caching=False)
    rows = {}
    with Engine(EngineConfig(**common, quantization="auto")) as quantized, \
            Engine(EngineConfig(**common, quantization="none")) as floats:
        print(f"\n{'batch':>5} " + " ".join(f"{p:>8}" for p in PATHS) + f" {'none':>8}  tok/s "
              f"({quantized.core.config.dtype}, {threads} thread(s))")
        for batch in batches:
            row = {}
            for path in PATHS:
                route_rows(quantized.core.runner.model, path)
                row[path] = decode_tok_s(quantized, batch)
            row["none"] = decode_tok_s(floats, batch)
            print(f"{batch:>5} " + " ".join(f"{v:>8.1f}" for v in row.values()), flush=True)
            rows[batch] = row
    torch.set_num_threads(1)
    return rows
