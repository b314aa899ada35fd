"""Linear and embedding layers over quantized weights (replicas/quant/layouts.py).

A layer picks its path by the rows it multiplies:
- up to `kernel_max_rows` (small decode batches): the integer kernel reads the
  weights as they are stored; their bytes are what bounds such a step;
- up to `gemm_max_rows` (larger decode batches): the batch kernel dequantizes a
  few weight rows at a time into cache and multiplies them with every activation
  row in float;
- above (prefill chunks): the weights are dequantized into a reused buffer for
  torch's GEMM, whose arithmetic is then most of the cost.
The bounds are measured (docs/performance.md, "Quantized weights").
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from replicas.quant.kernel import (ACTIVATION_DTYPES, WeightDesc, dequantize_into, gather_rows,
                                   quant_gemm_into, quant_matmul_into)
from replicas.quant.layouts import QuantizedWeight

# Rows at and below which each path runs, by activation dtype (measured in the engine,
# where the weights stream from memory: `python -m loadtests.bench_engine --paths`,
# docs/performance.md
# "Quantized weights"). bfloat16's float GEMMs are faster, so its integer kernel
# gives way sooner.
KERNEL_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 8}
GEMM_MAX_ROWS = 32


class _DequantBuffer:
    """One float buffer per dtype, shared by every layer of the process: a layer's
    dequantized weight lives only for its own GEMM, so the largest layer's size is
    all the memory this path takes."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype)
            self._buffers[dtype] = buffer
        return buffer[:numel]


DEQUANT_BUFFER = _DequantBuffer()


class QuantLinear(nn.Module):
    """y = x @ W.T + b, W given as quantized parts stacked by rows (a fused q/k/v or
    gate/up whose parts came in different types stays several parts). On a GPU every
    batch runs the Triton kernel (replicas/quant/triton_matmul.py)."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None = None):
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a QuantLinear needs parts of one in_features")
        self.parts = parts
        self._descs = [WeightDesc.of(p) for p in parts]
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", bias, persistent=False)
        # None: KERNEL_MAX_ROWS of the activations' dtype
        self.kernel_max_rows: int | None = None
        self.gemm_max_rows = GEMM_MAX_ROWS

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def sources(self) -> list[str]:
        return [p.source for p in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, self.in_features).contiguous()
        if x.is_cuda:
            y = self._cuda_forward(x)
            if self.bias is not None:
                y += self.bias
            return y if len(shape) == 2 else y.view(*shape[:-1], self.out_features)
        if x.dtype not in ACTIVATION_DTYPES or x.device.type != "cpu":
            raise TypeError(f"quantized linear layers run float32 or bfloat16 on CPU, got "
                            f"{x.dtype} on {x.device}")
        rows = x.shape[0]
        kernel_max_rows = self.kernel_max_rows
        if kernel_max_rows is None:
            kernel_max_rows = KERNEL_MAX_ROWS[x.dtype]
        if rows <= kernel_max_rows:
            y = self._kernel_forward(x, quant_matmul_into)
        elif rows <= self.gemm_max_rows:
            y = self._kernel_forward(x, quant_gemm_into)
        else:
            y = F.linear(x, self.dequantized(x.dtype))
        if self.bias is not None:
            y += self.bias
        return y if len(shape) == 2 else y.view(*shape[:-1], self.out_features)

    def _threads(self) -> int:
        # NOTE: torch's count at each call: the engine sets it per step (idle cores)
        return torch.get_num_threads()

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor:
        from replicas.quant.triton_matmul import quant_matmul_into as triton_matmul_into
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        column = 0
        for part in self.parts:
            triton_matmul_into(x, part, out, column)
            column += part.out_features
        return out

    def to_device(self, device: torch.device) -> "QuantLinear":
        """This layer with its weights on `device` (a new layer; the bias moves too)."""
        bias = None if self.bias is None else self.bias.to(device)
        return QuantLinear([p.to(device) for p in self.parts], bias)

    def _kernel_forward(self, x: torch.Tensor, kernel) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        column, threads = 0, self._threads()
        for desc in self._descs:
            kernel(x, desc, out, column, threads)
            column += desc.out_features
        return out

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(N, K) weight in `dtype`, in the shared buffer (valid until the next layer's)."""
        buffer = DEQUANT_BUFFER.take(self.out_features * self.in_features, dtype)
        weight = buffer.view(self.out_features, self.in_features)
        row, threads = 0, self._threads()
        for desc in self._descs:
            dequantize_into(desc, weight[row:row + desc.out_features], threads)
            row += desc.out_features
        return weight


class QuantEmbedding(nn.Module):
    """Token embeddings read from a quantized matrix, row by row; the same weight
    serves a tied lm-head (one copy in memory)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight_q = weight
        self._desc = WeightDesc.of(weight)  # NOTE: read on CPU only
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_cuda:  # NOTE: torch's operators over the selected rows' codes
            rows = self.weight_q.select_rows(ids.reshape(-1)).dequantize().to(self.dtype)
        else:
            rows = gather_rows(self._desc, ids.reshape(-1), self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def to_device(self, device: torch.device) -> "QuantEmbedding":
        return QuantEmbedding(self.weight_q.to(device), self.dtype)
