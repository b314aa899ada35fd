"""Resolves `dtype: auto` at start-up to what this device runs natively.

On a CPU `auto` runs bfloat16 where the CPU has native bfloat16 instructions and
the checkpoint carries no more precision than that: a bfloat16 checkpoint, or a
GGUF file whose matrices are quantized (bfloat16's rounding is far below a 4- or
8-bit quantization's own error). There bfloat16 GEMMs and the decode attention
kernel over a bfloat16 cache decode faster than float32 wherever matrix multiplies
dominate the step (docs/performance.md: the trained preset). Every other checkpoint
(float32, float16, unnamed) runs float32 on CPU: float32 is what the parity tests
hold exact against transformers, and bfloat16's tokens are not bit-identical to
float32's. Without native instructions half precision is emulated and several times
slower, so `auto` picks float32 there. On CUDA `auto` takes the checkpoint's own
dtype (`torch_dtype`, or `dtype` as transformers 5 writes it), as float16 for a
bfloat16 checkpoint on GPUs without bfloat16 (before compute capability 8.0). An
explicit dtype is honoured, with a warning where it is slower than `auto`'s. The
choice and its reason are logged.
"""
from __future__ import annotations

import json
import logging
import os

from replicas.gguf.convert import matrix_types

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


# GGUF matrix types that carry more precision than bfloat16 keeps (the rest are
# quantized, or bfloat16 itself)
_WIDE_GGUF_TYPES = ("F32", "F64", "F16")


def carries_at_most_bfloat16(model_dir: str) -> str | None:
    """Why the checkpoint's weights carry no more precision than bfloat16 keeps, or
    None: a bfloat16 checkpoint, or one converted from a GGUF file whose matrices
    are all quantized (or bfloat16)."""
    if checkpoint_dtype(model_dir) == "bfloat16":
        return "the checkpoint is bfloat16"
    types = matrix_types(model_dir)
    if types and not any(t in _WIDE_GGUF_TYPES for t in types):
        return f"the checkpoint's matrices are {'/'.join(types)} in its GGUF file"
    return None


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
        elif on_cpu and dtype == "float16":
            logger.warning("dtype float16 on a CPU runs without the attention kernel and "
                           "packed linear layers, slower than float32; dtype auto would pick "
                           "float32")
            why += " (slower than float32 on CPU)"
        elif on_cpu and dtype == "bfloat16":
            logger.info("dtype bfloat16 on a CPU with native bfloat16: faster than float32 "
                        "where matrix multiplies dominate the step, tokens not bit-identical "
                        "to float32's")
            why += " (native bfloat16 on this CPU)"
    elif on_cpu:
        narrow = carries_at_most_bfloat16(model_dir)
        if narrow is not None and cpu_runs_natively("bfloat16", flags):
            dtype, why = "bfloat16", (f"auto: {narrow} and this CPU runs bfloat16 natively "
                                      "(dtype float32 runs exact float32)")
        else:
            ckpt = checkpoint_dtype(model_dir) or "unnamed"
            dtype, why = "float32", (f"auto: the checkpoint is {ckpt}"
                                     + ("" if narrow is None else
                                        f" ({narrow}; this CPU has no native bfloat16)"))
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
