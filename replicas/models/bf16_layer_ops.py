"""RMSNorm (with the residual add before it), rotary and SiLU-times-up of a decoder
layer in bfloat16 on a CPU, one C pass each (csrc/bf16_layer_ops.c).

Why: in bfloat16 torch runs each of them as a chain of small operators with a
bfloat16 tensor between each, and on a CPU that chain costs a tenth of a decode
step of the trained preset. The kernel rounds where torch rounds, so its results
are torch's but for a rare last-bit difference (llama.py keeps torch's expressions
for every other dtype and device, and where the kernel does not build).
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from replicas.attention.native_kernels import load_library

logger = logging.getLogger("stepstream")

SOURCE = Path(__file__).resolve().parent / "csrc" / "bf16_layer_ops.c"

_P = ctypes.c_void_p
_I = ctypes.c_int64


class Bf16LayerOps:
    """The kernel's three functions over torch tensors (bfloat16, CPU, contiguous)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [_P] * 5 + [_I, _I, ctypes.c_float, ctypes.c_int]
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_P, _P, _I, _I, ctypes.c_int]
        self._rotary = lib.rotary_bf16
        self._rotary.restype = None
        self._rotary.argtypes = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, h): h = x, or x + residual (a new tensor), normed = RMSNorm(h)."""
        _check(x, weight, *(() if residual is None else (residual,)))
        D = x.shape[-1]
        if weight.shape != (D,) or (residual is not None and residual.shape != x.shape):
            raise ValueError("rms_norm got inconsistent shapes")
        out = torch.empty_like(x)
        h = x if residual is None else torch.empty_like(x)
        self._rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                       0 if residual is None else h.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), x.numel() // D, D, eps, torch.get_num_threads())
        return out, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of (T, 2 * I) -> (T, I)."""
        _check(gate_up)
        T, two_i = gate_up.shape
        out = torch.empty((T, two_i // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), T, two_i // 2,
                       torch.get_num_threads())
        return out

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous rotated q (T, heads, d) and k (T, kv heads, d) from the q and k at
        the front of each (T, width) qkv row; cos and sin (T, 1, d) or (T, d)."""
        if qkv.dtype != torch.bfloat16 or qkv.device.type != "cpu" or qkv.stride(-1) != 1:
            raise TypeError("rotary needs a bfloat16 CPU qkv with contiguous rows")
        T = qkv.shape[0]
        cos, sin = cos.reshape(T, head_dim), sin.reshape(T, head_dim)
        _check(cos, sin)
        if qkv.shape[1] < (num_heads + num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError("rotary got inconsistent shapes")
        q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype)
        k = torch.empty((T, num_kv_heads, head_dim), dtype=qkv.dtype)
        self._rotary(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                     q.data_ptr(), k.data_ptr(), T, num_heads, num_kv_heads, head_dim,
                     torch.get_num_threads())
        return q, k


def _check(*tensors: torch.Tensor) -> None:
    # NOTE: the kernel trusts its pointers: wrong dtypes or strides would read garbage
    for t in tensors:
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"the bfloat16 layer ops need contiguous bfloat16 CPU tensors; "
                            f"got {t.dtype} on {t.device}")


_ops: Bf16LayerOps | None = None
_problem: str | None = None


def load_bf16_layer_ops() -> tuple[Bf16LayerOps | None, str | None]:
    """(ops, None), or (None, why the kernel is unavailable). Loaded once per process."""
    global _ops, _problem
    if _ops is None and _problem is None:
        lib, _problem = load_library("bf16_layer_ops", SOURCE)
        if lib is not None:
            _ops = Bf16LayerOps(lib)
        else:
            logger.warning("bfloat16 layer ops run as torch operators: %s", _problem)
    return _ops, _problem
