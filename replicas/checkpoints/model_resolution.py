"""Which model an EngineConfig names, resolved once at start-up.

A preset name becomes its generated directory (replicas/checkpoints/presets.py), `dtype: auto`
becomes what this device runs natively (replicas/checkpoints/dtype_choice.py), and an unset
`max_model_len` becomes the checkpoint's own context length. Everything after
start-up reads the resolved values, so no other code repeats these rules.

NOTE: imports no torch; the checkpoint's config.json is all it reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from replicas.config import EngineConfig
from replicas.checkpoints.dtype_choice import resolve_dtype
from replicas.models.model_config import ModelConfig
from replicas.checkpoints.presets import ensure_model_dir
from replicas.quant.choice import resolve_quantization


@dataclass(slots=True, frozen=True)
class ResolvedModel:
    config: EngineConfig  # as given, with its dtype and quantization resolved
    model_dir: str
    model_config: ModelConfig
    max_model_len: int

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.model_config.eos_token_ids)


def resolve_model(config: EngineConfig) -> ResolvedModel:
    model_dir = ensure_model_dir(config.model)
    dtype, _ = resolve_dtype(config.dtype, config.device, model_dir)
    requested = config.quantization
    if config.tensor_parallel_size > 1:
        # NOTE: the split runs float weights: a GGUF file is dequantized at load
        if requested not in ("auto", "none"):
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} runs float "
                             f"weights: quantization {requested} cannot be split (use auto or none)")
        requested = "none"
    quantization, _ = resolve_quantization(requested, config.device, model_dir)
    config = dataclasses.replace(config, dtype=dtype, quantization=quantization)
    model_config = ModelConfig.from_dir(model_dir)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    return ResolvedModel(config, model_dir, model_config, max_model_len)
