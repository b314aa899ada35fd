"""y = x @ W.T on a GPU with W in a layout of replicas/quant/layouts.py: one Triton
kernel reads the codes and their scales (and mins) as stored, dequantizes each
(BLOCK_N x 32) tile in registers and multiplies it with tl.dot in float32 sums.

Why: decode at small batches reads every weight once per step, so a 4-bit weight
is a quarter of bfloat16's bytes; the tile's dequantization is arithmetic the
tensor cores leave idle anyway. One kernel serves every layout and batch size
(BLOCK_M follows the rows). The weights are rounded to the activations' dtype
before the dot, as a float model's are.

Runs on CPU tensors under `TRITON_INTERPRET=1` (set before this module is
imported), which is how the CPU tests check it; tests/gpu/test_gpu_quant.py runs it
compiled.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from replicas.quant.layouts import QuantizedWeight

# NOTE: the interpreter's tl.dot on bfloat16 operands returns garbage: there the dot
# runs on float32 copies of the same (rounded) values; compiled, on the tensor cores
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quant_matmul_kernel(x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr, M, N, K, ldo,
                         U4: tl.constexpr, G16: tl.constexpr, HAS_MINS: tl.constexpr,
                         DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, 32)
    row_ok = rows < M
    col_ok = cols < N
    ngroups = K // 16 if G16 else K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // 32):
        x = tl.load(x_ptr + rows[:, None] * K + b * 32 + ks[None, :], mask=row_ok[:, None],
                    other=0.0)
        if U4:
            # NOTE: values 0..15 of a block are the low nibbles of its 16 bytes, 16..31
            # the high ones
            byte = tl.load(codes_ptr + cols[:, None] * (K // 2) + b * 16 + (ks[None, :] % 16),
                           mask=col_ok[:, None], other=0)
            code = ((byte >> ((ks[None, :] // 16) * 4)) & 0x0F).to(tl.float32)
        else:
            code = tl.load(codes_ptr + cols[:, None] * K + b * 32 + ks[None, :],
                           mask=col_ok[:, None], other=0).to(tl.float32)
        if G16:
            group = cols[:, None] * ngroups + b * 2 + ks[None, :] // 16
        else:
            group = cols[:, None] * ngroups + b + ks[None, :] * 0
        scale = tl.load(scales_ptr + group, mask=col_ok[:, None], other=0.0).to(tl.float32)
        w = code * scale
        if HAS_MINS:
            w += tl.load(mins_ptr + group, mask=col_ok[:, None], other=0.0).to(tl.float32)
        w = w.to(x.dtype)  # as a float model's weights are rounded
        if DOT_F32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + rows[:, None] * ldo + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _block_m(rows: int) -> int:
    # NOTE: tl.dot needs at least 16 rows a tile; fewer rows are masked
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def quant_matmul_into(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor,
                      column: int) -> None:
    """out[:, column:column + N] = x @ W.T; x (M, K) contiguous float32, bfloat16 or
    float16 on the weight's device; out (M, *) contiguous, of x's dtype."""
    M, K = x.shape
    N = weight.out_features
    block_m, block_n = _block_m(M), 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    mins = weight.mins if weight.mins is not None else weight.scales
    _quant_matmul_kernel[grid](x, weight.codes, weight.scales, mins, out[:, column:], M, N, K,
                               out.stride(0), U4=weight.layout == "u4", G16=weight.group == 16,
                               HAS_MINS=weight.mins is not None, DOT_F32=_INTERPRETED,
                               BLOCK_M=block_m, BLOCK_N=block_n)
