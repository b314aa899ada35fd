"""This machine's matrix-multiply limit at a model's own shapes, and the engine's
decode throughput as a share of it: `python -m loadtests.bench_engine --roofline`.

A decode step of B streams is, for its matrix multiplies, one (B x in) @ (in x out)
product per linear layer of the model (the packed q/k/v and gate/up projections, o,
down) times the layers, plus the lm-head's (B x hidden) @ (hidden x vocab). Timing
each product at exactly those shapes, in each dtype, by `torch.mm` and by the engine's
oneDNN-packed layer, the faster of the two, gives the step's GEMM time and so
the tokens per second no engine could beat with these kernels: the **roofline**
(attention, norms, sampling and Python are all on top of it). The engine's decode
throughput is B streams over the engine's step time while all B decode, on the same
machine in the same run, with that step's time split into GEMMs, attention and the
rest (loadtests/engine/decode_breakdown.py). Streams over the median TPOT of a run through
the streaming engine (loadtests/engine/engine_runner.py), printed beside it, also counts the
prefills a stream waits through after its first token.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from loadtests.engine.decode_breakdown import MAX_TOKENS, breakdown
from loadtests.engine.engine_runner import engine_config, greedy, random_prompts, run_engine, sessions_of
from loadtests.serving.metrics import format_table
from replicas.config import EngineConfig
from replicas.kv_cache.kv_budget import bytes_per_block

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step_products(config) -> list[tuple[str, int, int, int]]:
    """(name, in features, out features, products per step) of a decode step."""
    h, hd = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * hd
    layers = config.num_layers
    return [("qkv", h, qkv, layers), ("o", config.num_heads * hd, h, layers),
            ("gate_up", h, 2 * config.intermediate_size, layers),
            ("down", config.intermediate_size, h, layers),
            ("lm_head", h, config.vocab_size, 1)]


def matmul_flops_per_token(config) -> int:
    return sum(2 * k * n * count for _, k, n, count in step_products(config))


def attention_flops_per_token(config, context_len: int) -> int:
    """Scores and weighted sum over `context_len` keys, every layer."""
    return 4 * config.num_layers * config.num_heads * config.head_dim * context_len


def median_seconds(run, repeats: int = 7) -> float:
    """Median wall time of `run()` over `repeats` calls, after two untimed ones."""
    for _ in range(2):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_mm(batch: int, k: int, n: int, dtype: torch.dtype) -> float:
    """Median seconds of one (batch x k) @ (k x n) product by torch.mm."""
    x, w = torch.randn(batch, k).to(dtype), torch.randn(k, n).to(dtype)
    return median_seconds(lambda: torch.mm(x, w))


def time_packed(batch: int, k: int, n: int, dtype: torch.dtype) -> float | None:
    """Median seconds of the same product by the engine's oneDNN-packed linear layer
    (float32 or bfloat16 on CPU), or None where the engine does not pack."""
    from replicas.models.packed_linear import PACKED_DTYPES, PackedLinear, packing_available

    if dtype not in PACKED_DTYPES or packing_available() is not None:
        return None
    try:
        layer = PackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype), batch)
    except RuntimeError:  # oneDNN will not pack this dtype here: neither does the engine
        return None
    x = torch.randn(batch, k).to(dtype)
    with torch.inference_mode():
        return median_seconds(lambda: layer(x))


def roofline(config, batch: int, dtype: torch.dtype) -> dict:
    """The step's GEMM time at `batch` and what it allows. Each product is timed by
    torch.mm and by the packed layer the engine runs; the faster one is the limit
    (packing skips the weight reordering a plain GEMM call does each time)."""
    products = step_products(config)
    mm = {name: time_mm(batch, k, n, dtype) for name, k, n, _ in products}
    packed = {name: time_packed(batch, k, n, dtype) for name, k, n, _ in products}
    best = {name: min(mm[name], packed[name] or math.inf) for name in mm}
    step_s = sum(best[name] * count for name, _, _, count in products)
    mm_step_s = sum(mm[name] * count for name, _, _, count in products)
    flops = matmul_flops_per_token(config) * batch
    return {"gemm_step_ms": step_s * 1e3, "roofline_tok_s": batch / step_s,
            "gemm_gflops": flops / step_s / 1e9, "mm_gflops": flops / mm_step_s / 1e9,
            "lm_head_share": best["lm_head"] / step_s}


def kv_cache_gib(config, batch: int, num_tokens: int, dtype: str) -> float:
    """A cache that holds `batch` streams of `num_tokens` at once, whatever the CPU
    default would be on the machine at hand (it depends on the memory available)."""
    per_token = bytes_per_block(EngineConfig(dtype=dtype, block_size=1), config)
    nbytes = per_token * batch * num_tokens
    return max(1.0, round(1.25 * nbytes / 2**30, 2))


def engine_decode(model: str, batch: int, dtype: str, input_len: int, output_len: int,
                  model_config) -> dict:
    kv_gib = kv_cache_gib(model_config, batch, input_len + max(output_len, MAX_TOKENS), dtype)
    config = engine_config(model, dtype=dtype, max_num_seqs=max(batch, 1), kv_cache_gib=kv_gib)
    row = run_engine(config, sessions_of(random_prompts(batch, input_len), greedy(output_len)),
                     batch)
    # NOTE: streams / median TPOT counts the prefills a stream waits through after its
    # first token; the full-batch step (decode_breakdown) is what the roofline bounds.
    step = breakdown(model, batch, dtype, input_len, kv_gib)
    return {"decode_tok_s": step["full_batch_tok_s"], "step_ms": step["step_ms"],
            "gemm_share": step["gemm_share"], "attention_share": step["attention_share"],
            "rest_share": step["rest_share"],
            "tpot_decode_tok_s": batch * 1000.0 / row["median_tpot_ms"],
            "output_throughput": row["output_throughput"], "median_tpot_ms": row["median_tpot_ms"]}


def report(models: list[str], batches: list[int], input_len: int, output_len: int,
           dtypes: tuple[str, ...] = tuple(DTYPES)) -> dict:
    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.model_config import ModelConfig

    result = {}
    for model in models:
        config = ModelConfig.from_dir(ensure_model_dir(model))
        context = input_len + output_len // 2
        rows = {}
        for dtype in dtypes:
            for batch in batches:
                row = roofline(config, batch, DTYPES[dtype])
                row.update(engine_decode(model, batch, dtype, input_len, output_len, config))
                row["share_of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
                rows[f"{dtype}, {batch} streams"] = row
        result[model] = {"matmul_gflop_per_token": matmul_flops_per_token(config) / 1e9,
                         "attention_gflop_per_token": attention_flops_per_token(config, context)
                         / 1e9, "torch_threads": torch.get_num_threads(), "rows": rows}
        print(f"\n{model}: {result[model]['matmul_gflop_per_token']:.3f} GFLOP of matrix "
              f"multiplies per token (+ {result[model]['attention_gflop_per_token']:.3f} of "
              f"attention at {context} tokens of context); {torch.get_num_threads()} torch "
              f"threads; {input_len} in / {output_len} out, greedy")
        print(format_table(rows, [("gemm_step_ms", "GEMM step ms", ".2f"),
                                  ("mm_gflops", "torch.mm GFLOP/s", ".0f"),
                                  ("gemm_gflops", "best GEMM GFLOP/s", ".0f"),
                                  ("lm_head_share", "lm-head", ".0%"),
                                  ("roofline_tok_s", "roofline tok/s", ".0f"),
                                  ("decode_tok_s", "engine decode tok/s", ".0f"),
                                  ("share_of_roofline", "share", ".0%"),
                                  ("gemm_share", "step: GEMM", ".0%"),
                                  ("attention_share", "attention", ".0%"),
                                  ("rest_share", "rest", ".0%"),
                                  ("tpot_decode_tok_s", "streams / TPOT", ".0f"),
                                  ("output_throughput", "engine tok/s (with prefill)", ".0f")]),
              flush=True)
    return result
