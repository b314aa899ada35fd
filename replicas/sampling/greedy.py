"""Greedy tokens: each row's first maximum, as torch.argmax gives it.

On a CPU, float32 logits go through a C pass (csrc/first_max.c): torch's argmax
keeps an index with every comparison and, over a large vocabulary, costs a few
percent of a decode step. Everywhere else (CUDA, other dtypes, no C compiler)
this is torch.argmax.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from replicas.attention.native_kernels import load_library

logger = logging.getLogger("stepstream")

SOURCE = Path(__file__).resolve().parent / "csrc" / "first_max.c"

_kernel = None
_problem: str | None = None


def load_first_max():
    """(ctypes function, None), or (None, why the kernel is unavailable). Loaded once
    per process (`load_library`); the engine loads it at start so no request waits
    for the build."""
    global _kernel, _problem
    if _kernel is None and _problem is None:
        lib, _problem = load_library("first_max", SOURCE)
        if lib is None:
            logger.warning("greedy sampling uses torch.argmax: %s", _problem)
        else:
            fn = lib.first_max_rows
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int]
            _kernel = fn
    return _kernel, _problem


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) -> (rows,) int64: the index of each row's first maximum (a row's
    first NaN if it has one), equal to `logits.argmax(dim=-1)`."""
    kernel = _kernel
    if (kernel is None or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
           torch.get_num_threads())
    return out
