"""Load a Llama-family HF directory (config.json + *.safetensors by HF names)."""
from __future__ import annotations

import glob
import logging
import os

import torch

from replicas.models.llama import LlamaForCausalLM
from replicas.models.model_config import ModelConfig
from replicas.quant.choice import GGUF_NATIVE, SCHEMES, gguf_source_file

logger = logging.getLogger("stepstream")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    return weights


def load_model(model_dir: str, dtype: str, device: torch.device, max_positions: int,
               quantization: str = "none") -> LlamaForCausalLM:
    """The model, its weights as `quantization` says (replicas/quant/choice.py; resolved):
    gguf keeps a GGUF file's quantized matrices, int8/int4 quantize float weights."""
    if quantization != "none" and device.type == "cpu":
        from replicas.quant.kernel import load_quant_kernels
        _, problem = load_quant_kernels()
        if problem is not None and quantization == GGUF_NATIVE:
            logger.warning("the GGUF file's weights run dequantized (quantization none): %s",
                           problem)
            quantization = "none"
        elif problem is not None:
            raise ValueError(f"quantization {quantization} cannot run here: {problem}")
    if quantization == GGUF_NATIVE:
        from replicas.quant.gguf_model import load_gguf_model
        model = load_gguf_model(model_dir, gguf_source_file(model_dir), _DTYPES[dtype],
                                max_positions)
    else:
        model = _load_float_model(model_dir, dtype, device, max_positions)
        if quantization in SCHEMES:
            from replicas.quant.model_quantization import quantize_linears
            quantize_linears(model, quantization)
    if quantization != "none" and device.type != "cpu":
        from replicas.quant.model_quantization import move_quantized
        model = model.to(device)
        move_quantized(model, device)
    return model


def _load_float_model(model_dir: str, dtype: str, device: torch.device, max_positions: int
                      ) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    weights = _read_safetensors(model_dir)
    torch_dtype = _DTYPES[dtype]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(torch_dtype)

    def take(name: str) -> torch.Tensor:
        try:
            return weights.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint in {model_dir!r} lacks weight {name!r}") from None

    state: dict[str, torch.Tensor] = {"embed_tokens.weight": take("model.embed_tokens.weight"),
                                      "norm.weight": take("model.norm.weight")}
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{n}_proj.weight") for n in "qkv"])
        if cfg.attention_bias:
            state[ours + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + f"{n}_proj.bias") for n in "qkv"])
        state[ours + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        if cfg.qk_norm:
            state[ours + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
            state[ours + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")])
        state[ours + "mlp.down_proj.weight"] = take(hf + "mlp.down_proj.weight")
        state[ours + "input_layernorm.weight"] = take(hf + "input_layernorm.weight")
        state[ours + "post_attention_layernorm.weight"] = take(hf + "post_attention_layernorm.weight")
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    # NOTE: ignore rotary caches some checkpoints carry; anything else is a bug.
    leftover = [n for n in weights if "rotary_emb" not in n]
    if leftover:
        raise ValueError(f"unexpected weights in {model_dir!r}: {leftover[:5]}")
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        param.data.copy_(state.pop(name).to(torch_dtype))
    if state:
        raise ValueError(f"weights without a place in the model: {list(state)[:5]}")
    # the rope tables were lost on meta: rebuild them in float32 on the device
    model.rope.build(cfg, max_positions, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()
