"""Weight-only quantization of float weights at load (`--quantization int8|int4`),
so a float Hugging Face checkpoint runs in a quarter (int8: about a half) of its
float32 bytes through the same kernels as a GGUF file's own types.

- int8: signed codes, one float16 scale per 32 values of a row (symmetric, as
  GGUF's Q8_0): finer than one scale per row, for half a bit per weight more.
- int4: 4-bit codes, a float16 scale and min per 32 values of a row (asymmetric,
  as GGUF's Q4_1).
Scales are rounded to float16 before the codes are chosen, so each code is the
nearest for the scale the kernel will use.
"""
from __future__ import annotations

import numpy as np
import torch

from replicas.quant.choice import SCHEMES
from replicas.quant.layouts import VALUES_PER_BLOCK, QuantizedWeight, from_arrays

GROUP = 32


def _as_f16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 where they fit (float32 otherwise)."""
    with np.errstate(over="ignore"):
        rounded = values.astype(np.float16).astype(np.float32)
    return rounded if np.isfinite(rounded).all() else values


def quantize_weight(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """The (N, K) float weight in `scheme`'s layout; K must be a multiple of 32."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    N, K = weight.shape
    if K % VALUES_PER_BLOCK:
        raise ValueError(f"{scheme} needs in_features a multiple of {VALUES_PER_BLOCK}, got {K}")
    w = weight.detach().float().cpu().numpy().reshape(N, K // GROUP, GROUP)
    if scheme == "int8":
        scales = _as_f16(np.abs(w).max(axis=-1) / 127.0)
        inv = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        codes = np.clip(np.rint(w * inv[..., None]), -127, 127).astype(np.int8)
        return from_arrays("s8", GROUP, codes.reshape(N, K), scales, None, scheme)
    low, high = w.min(axis=-1), w.max(axis=-1)
    mins = _as_f16(low)
    scales = _as_f16((high - mins) / 15.0)
    inv = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
    codes = np.clip(np.rint((w - mins[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return from_arrays("u4", GROUP, codes.reshape(N, K), scales, mins, scheme)
