"""`--quantization int8|int4`: a float model's linear layers replaced by
QuantLinear over weights quantized at load (replicas/quant/float_quantize.py).

A tied embedding is quantized once and serves the lm-head and the lookups from
the same bytes; an untied embedding stays float (a lookup reads a few rows, not
the matrix). A layer whose in_features is not a multiple of 32 stays float.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from replicas.quant.float_quantize import quantize_weight
from replicas.quant.linear import QuantEmbedding, QuantLinear

logger = logging.getLogger("stepstream")


def quantize_linears(model: nn.Module, scheme: str) -> int:
    """Replace the model's nn.Linear layers in place; returns how many."""
    tied = getattr(model, "lm_head", None) is not None and getattr(
        model, "embed_tokens", None) is not None and model.lm_head.weight is model.embed_tokens.weight
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    num_quantized, kept = 0, []
    for parent, name, child in targets:
        if child.in_features % 32:
            kept.append(name)
            continue
        weight = quantize_weight(child.weight, scheme)
        bias = None if child.bias is None else child.bias.detach()
        if tied and child is model.lm_head:
            model.embed_tokens = QuantEmbedding(weight, child.weight.dtype)
        setattr(parent, name, QuantLinear([weight], bias))
        num_quantized += 1
    logger.info("quantized %d linear layers to %s at load%s", num_quantized, scheme,
                f" ({len(kept)} stay float: in_features not a multiple of 32)" if kept else "")
    return num_quantized


def move_quantized(model: nn.Module, device: torch.device) -> None:
    """Put every quantized layer's weights on `device`, in place; a tied lm-head keeps
    sharing its embedding's weight. (nn.Module.to does not see them: they are plain
    tensors, not parameters.)"""
    moved: dict[int, object] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantEmbedding):
                new = moved.setdefault(id(child.weight_q), child.to_device(device))
                setattr(parent, name, new)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                embedding = moved.get(id(child.parts[0])) if len(child.parts) == 1 else None
                if embedding is not None:  # the tied lm-head: the embedding's moved copy
                    setattr(parent, name, QuantLinear([embedding.weight_q]))
                else:
                    setattr(parent, name, child.to_device(device))
