"""The two limits quantized serving is measured against, on this machine, now:

- read bandwidth: `torch.sum` over 256 MB on every core (GB/s). A lone decode
  stream reads every weight once per token, so weight bytes / bandwidth is the
  least time a token can take: the roofline of `loadtests/serving/quant_serving.sh`.
- a prompt's GEMM time: every (prompt x in) @ (in x out) product a prefill of
  `--prompt-len` tokens runs (loadtests/engine/gemm_roofline.py's shapes; the lm-head for
  the one row sampled), by torch.mm in the engine's dtype on every core: the least
  time its TTFT can take with these kernels.

    python -m loadtests.bench_engine --limits --model smollm2-135m --input-len 128
"""
from __future__ import annotations

import json
import os

import torch

from loadtests.engine.gemm_roofline import median_seconds, step_products, time_mm


def read_bandwidth_gbs(megabytes: int = 256) -> float:
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return data.nbytes / median_seconds(lambda: data.sum(), repeats=9) / 1e9


def prompt_gemm_ms(model: str, prompt_len: int, dtype: str) -> float:
    from replicas.checkpoints.presets import ensure_model_dir
    from replicas.models.model_config import ModelConfig

    config = ModelConfig.from_dir(ensure_model_dir(model))
    total = 0.0
    for name, k, n, count in step_products(config):
        rows = 1 if name == "lm_head" else prompt_len
        total += count * time_mm(rows, k, n, getattr(torch, dtype))
    return total * 1e3


def report(model: str, prompt_len: int, dtype: str = "auto") -> dict:
    """Print and return the read bandwidth and the prompt's GEMM time, on every core."""
    from replicas.checkpoints.dtype_choice import resolve_dtype
    from replicas.checkpoints.presets import ensure_model_dir

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype = resolve_dtype(dtype, "cpu", ensure_model_dir(model))[0]
    result = {"read_bandwidth_gbs": round(read_bandwidth_gbs(), 2),
              "prompt_gemm_ms": round(prompt_gemm_ms(model, prompt_len, dtype), 2),
              "dtype": dtype, "threads": torch.get_num_threads()}
    print(json.dumps(result), flush=True)
    return result
