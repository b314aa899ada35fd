"""Linear layers with weights pre-packed for oneDNN, for float32 and bfloat16 on CPU.

A model's projections run as `x @ W.T` with W fixed for the life of the engine.
Reordering W once into oneDNN's blocked layout (the packing torch's own CPU
compiler applies to frozen weights) lets every step skip the repacking a plain
GEMM call does on each call, which matters at decode batch sizes. The packed
tensor replaces the original weight (no second copy); a weight shared with the
embedding (tied lm_head) is packed into its own copy. Packed and plain layers give
the same outputs bit for bit (the same oneDNN kernels; only the reordering moves).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger("stepstream")

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> str | None:
    """None when packing can run here, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch build lacks oneDNN's packed linear ops"
    return None


@functools.lru_cache(maxsize=None)
def packing_refused(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs `dtype` weights on this CPU, else its reason: bfloat16
    packing needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which many CPUs lack.
    Asked once per dtype, so a model of hundreds of layers gets one answer."""
    try:
        with torch.no_grad():
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError as error:
        return str(error)
    return None


class PackedLinear(nn.Module):
    """y = x @ W.T + b over a (T, in_features) input, W packed for oneDNN."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module, batch_size_hint: int) -> int:
    """Replace every float32 or bfloat16 CPU nn.Linear in `model` by a PackedLinear;
    returns how many.

    Logs and leaves the model as it is when packing cannot run here; layers of a
    dtype oneDNN will not pack on this CPU (bfloat16 without AVX-512) stay plain ones
    (one log line for them all), as does any layer it refuses on its own.
    """
    problem = packing_available()
    if problem is not None:
        logger.info("linear layers stay unpacked: %s", problem)
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype in PACKED_DTYPES]
    refused = {dtype: packing_refused(dtype) for dtype in {c.weight.dtype for *_, c in targets}}
    for dtype, why in refused.items():
        if why is not None:
            logger.info("%s linear layers stay unpacked on this CPU: %s",
                        str(dtype).removeprefix("torch."), why)
    num_packed = 0
    for parent, name, child in targets:
        if refused[child.weight.dtype] is not None:
            continue
        try:
            packed = PackedLinear(child, batch_size_hint)
        except RuntimeError as error:
            logger.info("linear layer %s stays unpacked: %s", name, error)
            continue
        setattr(parent, name, packed)
        num_packed += 1
    logger.info("packed %d linear layers for oneDNN (batch size hint %d)", num_packed,
                batch_size_hint)
    return num_packed
