"""Resolves `dtype: auto` at start-up to what this device runs natively.

On a CPU `auto` runs float32, whatever the checkpoint's dtype: the engine's fast
CPU path (the paged decode attention kernel and the oneDNN-packed linear layers)
is float32 only, and half precision goes through the plain torch path instead,
which is slower even on CPUs with native bfloat16 instructions (docs/performance.md)
and several times slower where half precision is emulated. On CUDA `auto` takes
the checkpoint's own dtype (`torch_dtype`, or `dtype` as transformers 5 writes it),
as float16 for a bfloat16 checkpoint on GPUs without bfloat16 (before compute
capability 8.0). An explicit half-precision dtype on a CPU is honoured, with a
warning. The choice and its reason are logged.
"""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("stepstream")

HALF_DTYPES = ("bfloat16", "float16")
# /proc/cpuinfo flags that mean native arithmetic in that dtype
_NATIVE_CPU_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),  # x86, and aarch64's "bf16"
    "float16": ("avx512_fp16", "amx_fp16", "fphp"),
}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_runs_natively(dtype: str, flags: set[str] | None = None) -> bool:
    if dtype not in HALF_DTYPES:
        return True
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _NATIVE_CPU_FLAGS[dtype])


def checkpoint_dtype(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value if value in ("float32",) + HALF_DTYPES else None


def _cuda_has_bf16() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_dtype(requested: str, device: str, model_dir: str,
                  flags: set[str] | None = None, cuda_bf16: bool | None = None) -> tuple[str, str]:
    """(the dtype to run, why); logs both. `flags` and `cuda_bf16` default to this
    machine's."""
    on_cpu = device.split(":")[0] == "cpu"
    if requested != "auto":
        dtype, why = requested, "requested explicitly"
        if on_cpu and not cpu_runs_natively(dtype, flags):
            logger.warning("dtype %s on a CPU without native %s instructions is emulated and "
                           "several times slower than float32; dtype auto would pick float32",
                           dtype, dtype)
            why += " (emulated on this CPU)"
        elif on_cpu and dtype in HALF_DTYPES:
            logger.warning("dtype %s on a CPU skips the float32 attention kernel and packed "
                           "linear layers, and runs slower than float32; dtype auto would pick "
                           "float32", dtype)
            why += " (slower than float32 on CPU)"
    elif on_cpu:
        ckpt = checkpoint_dtype(model_dir) or "unnamed"
        dtype, why = "float32", (f"auto: the checkpoint is {ckpt}; on CPU the attention kernel "
                                 "and packed linear layers run float32")
    else:
        ckpt = checkpoint_dtype(model_dir)
        if ckpt is None:
            dtype, why = "float32", "auto: the checkpoint names no dtype"
        elif ckpt == "bfloat16" and not (_cuda_has_bf16() if cuda_bf16 is None else cuda_bf16):
            dtype, why = "float16", "auto: the checkpoint is bfloat16, which this GPU does not support"
        else:
            dtype, why = ckpt, "auto: the checkpoint's dtype"
    logger.info("dtype: %s (%s; device=%s)", dtype, why, device)
    return dtype, why
