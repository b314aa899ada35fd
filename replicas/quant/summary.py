"""What weights a model runs, in words and bytes: the console's model line and the
model card say it (`Q4_1/Q8_0 (native), 97 MB`)."""
from __future__ import annotations

from torch import nn

from replicas.quant.linear import QuantEmbedding, QuantLinear


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take in memory, each shared tensor once (a tied
    embedding and lm-head are one)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        parts = (module.parts if isinstance(module, QuantLinear) else
                 [module.weight_q] if isinstance(module, QuantEmbedding) else [])
        for part in parts:
            if id(part) not in seen:
                seen.add(id(part))
                total += part.nbytes
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def weight_kinds(model: nn.Module, quantization: str) -> str:
    """`Q4_1/Q8_0 (native)`, `int4 (at load)`, or the float dtype the weights run in."""
    sources = sorted({source for module in model.modules()
                      for source in (module.sources if isinstance(module, QuantLinear) else
                                     [module.weight_q.source]
                                     if isinstance(module, QuantEmbedding) else [])})
    if sources:
        how = "native" if quantization == "gguf" else "at load"
        return f"{'/'.join(sources)} ({how})"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                     if p.dim() >= 2})
    return "/".join(dtypes) or "none"
