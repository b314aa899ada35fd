"""The quantized-weight kernels (csrc/quant_linear.c) over torch tensors.

Built on first use like the other C kernels (replicas/attention/native_kernels.py):
with the machine's compiler for this CPU, so an AVX2 machine gets the AVX2 path,
one with AVX512-VNNI the VNNI dot products, and any other CPU the portable C.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from replicas.attention.native_kernels import load_library
from replicas.quant.layouts import QuantizedWeight

logger = logging.getLogger("stepstream")

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_linear.c"
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class QuantKernels:
    """The library's three entry points, with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.linear = lib.quant_linear
        self.linear.restype = _C
        self.linear.argtypes = [_P, _C, _I, _I, _P, _C, _P, _P, _C, _I, _P, _C, _I, _I, _C]
        self.dequantize = lib.quant_dequantize
        self.dequantize.restype = _C
        self.dequantize.argtypes = [_P, _C, _P, _P, _C, _I, _I, _I, _P, _C, _C]
        self.gather_rows = lib.quant_gather_rows
        self.gather_rows.restype = _C
        self.gather_rows.argtypes = [_P, _C, _P, _P, _C, _I, _I, _I, _P, _I, _P, _C]


_kernels: QuantKernels | None = None
_problem: str | None = None


def load_quant_kernels() -> tuple[QuantKernels | None, str | None]:
    """(kernels, None), or (None, why they are unavailable). Loaded once per process."""
    global _kernels, _problem
    if _kernels is None and _problem is None:
        lib, _problem = load_library("quant_linear", SOURCE)
        if lib is not None:
            _kernels = QuantKernels(lib)
    return _kernels, _problem


def _weight_args(w: QuantizedWeight) -> tuple:
    return (w.codes.data_ptr(), int(w.layout == "u4"), w.scales.data_ptr(),
            0 if w.mins is None else w.mins.data_ptr(), int(w.scales_half), w.group)


def _need(kernels: QuantKernels | None) -> QuantKernels:
    if kernels is None:
        kernels, problem = load_quant_kernels()
        if kernels is None:
            raise RuntimeError(f"the quantized-weight kernels are unavailable: {problem}")
    return kernels


def quant_matmul_into(x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor, column: int,
                      num_threads: int) -> None:
    """out[:, column:column + N] = x @ w.T, with the integer kernel. x: (M, K)
    contiguous float32 or bfloat16; out: (M, *) contiguous, float32 or bfloat16."""
    kernels = _need(_kernels)
    M, K = x.shape
    code = kernels.linear(x.data_ptr(), int(x.dtype == torch.bfloat16), M, K, *_weight_args(w),
                          out.data_ptr() + column * out.element_size(),
                          int(out.dtype == torch.bfloat16), w.out_features, out.shape[1],
                          num_threads)
    if code != 0:
        raise RuntimeError(f"quant_linear failed ({code}) for {w.layout} weights of "
                           f"{w.out_features}x{w.in_features}, group {w.group}")


def dequantize_into(w: QuantizedWeight, out: torch.Tensor, num_threads: int) -> None:
    """out (N, K), float32 or bfloat16 = the weight's values (rounded to bfloat16)."""
    kernels = _need(_kernels)
    code = kernels.dequantize(*_weight_args(w), w.out_features, w.in_features, out.data_ptr(),
                              int(out.dtype == torch.bfloat16), num_threads)
    if code != 0:
        raise RuntimeError(f"quant_dequantize failed ({code})")


def gather_rows(w: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(len(ids), K) rows of the weight in `dtype` (float32 or bfloat16); ids (M,) int64,
    each in [0, N) (an IndexError otherwise)."""
    kernels = _need(_kernels)
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), w.in_features), dtype=dtype)
    code = kernels.gather_rows(*_weight_args(w), w.out_features, w.in_features, ids.data_ptr(),
                               ids.numel(), out.data_ptr(), int(dtype == torch.bfloat16))
    if code == -3:
        raise IndexError(f"token id out of range [0, {w.out_features})")
    if code != 0:
        raise RuntimeError(f"quant_gather_rows failed ({code})")
    return out
