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


class WeightDesc(ctypes.Structure):
    """csrc/quant_linear.c's QuantWeight: a weight's pointers and shape, built once
    per weight so that a call passes one pointer for all of it."""

    _fields_ = [("codes", _P), ("scales", _P), ("mins", _P), ("out_features", _I),
                ("in_features", _I), ("group", _I), ("codes_u4", ctypes.c_int32),
                ("scales_half", ctypes.c_int32)]

    @classmethod
    def of(cls, w: QuantizedWeight) -> "WeightDesc":
        # NOTE: holds raw pointers: the QuantizedWeight must outlive it (QuantLinear
        # keeps both)
        return cls(w.codes.data_ptr(), w.scales.data_ptr(),
                   None if w.mins is None else w.mins.data_ptr(), w.out_features,
                   w.in_features, w.group, int(w.layout == "u4"), int(w.scales_half))


class QuantKernels:
    """The library's entry points, with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.linear = lib.quant_linear
        self.linear.restype = _C
        self.linear.argtypes = [_P, _C, _I, _P, _P, _C, _I, _C]
        self.gemm = lib.quant_gemm
        self.gemm.restype = _C
        self.gemm.argtypes = [_P, _C, _I, _P, _P, _C, _I, _C]
        self.dequantize = lib.quant_dequantize
        self.dequantize.restype = _C
        self.dequantize.argtypes = [_P, _P, _C, _C]
        self.gather_rows = lib.quant_gather_rows
        self.gather_rows.restype = _C
        self.gather_rows.argtypes = [_P, _P, _I, _P, _C]


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


def need_kernels() -> QuantKernels:
    kernels = _kernels
    if kernels is None:
        kernels, problem = load_quant_kernels()
        if kernels is None:
            raise RuntimeError(f"the quantized-weight kernels are unavailable: {problem}")
    return kernels


def _matmul_into(entry: str, x: torch.Tensor, desc: WeightDesc, out: torch.Tensor, column: int,
                 num_threads: int) -> None:
    """out[:, column:column + N] = x @ W.T by the library's `entry` (quant_linear's
    signature). x: (M, K) contiguous float32 or bfloat16; out: (M, *) contiguous,
    float32 or bfloat16."""
    code = getattr(need_kernels(), entry)(
        x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], ctypes.addressof(desc),
        out.data_ptr() + column * out.element_size(), out.dtype == torch.bfloat16,
        out.shape[1], num_threads)
    if code != 0:
        raise RuntimeError(f"quant_{entry} failed ({code}) for weights of {desc.out_features}x"
                           f"{desc.in_features}, group {desc.group}")


def quant_matmul_into(x: torch.Tensor, desc: WeightDesc, out: torch.Tensor, column: int,
                      num_threads: int) -> None:
    """With the integer kernel (small batches: the weights read as stored)."""
    _matmul_into("linear", x, desc, out, column, num_threads)


def quant_gemm_into(x: torch.Tensor, desc: WeightDesc, out: torch.Tensor, column: int,
                    num_threads: int) -> None:
    """With the batch kernel: weight tiles dequantized into cache, float arithmetic
    (for batches above the integer kernel's rows)."""
    _matmul_into("gemm", x, desc, out, column, num_threads)


def dequantize_into(desc: WeightDesc, out: torch.Tensor, num_threads: int) -> None:
    """out (N, K), float32 or bfloat16 = the weight's values (rounded to bfloat16)."""
    code = need_kernels().dequantize(ctypes.addressof(desc), out.data_ptr(),
                                     out.dtype == torch.bfloat16, num_threads)
    if code != 0:
        raise RuntimeError(f"quant_dequantize failed ({code})")


def gather_rows(desc: WeightDesc, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(len(ids), K) rows of the weight in `dtype` (float32 or bfloat16); ids (M,) int64,
    each in [0, N) (an IndexError otherwise)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), desc.in_features), dtype=dtype)
    code = need_kernels().gather_rows(ctypes.addressof(desc), ids.data_ptr(), ids.numel(),
                                      out.data_ptr(), dtype == torch.bfloat16)
    if code == -3:
        raise IndexError(f"token id out of range [0, {desc.out_features})")
    if code != 0:
        raise RuntimeError(f"quant_gather_rows failed ({code})")
    return out
