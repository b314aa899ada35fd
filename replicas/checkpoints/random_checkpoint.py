"""Writes random Llama-family checkpoints (llama, mistral, qwen2, qwen3) as complete
Hugging Face directories: the presets' weights, and the small models of tests.

Imports torch and safetensors, so only preset materialisation
(`replicas.checkpoints.presets.ensure_model_dir`, lazily) and tests import it; the serving
path's `replicas.checkpoints.presets` does not.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from replicas.checkpoints.checkpoint_config import ASSETS_DIR, TOKENIZER_FILES, complete_config


def write_random_checkpoint(path: str | os.PathLike, config: dict, seed: int,
                            perturb: bool = True, dtype: str = "float32") -> str:
    """Write a complete HF directory (config, random weights with HF names, the
    stepstream tokenizer, generation config) for a llama/mistral/qwen2/qwen3 config.

    Missing `architectures`, `torch_dtype`, `head_dim`, `num_key_value_heads`,
    `tie_word_embeddings` and bos/eos/pad ids are written out explicitly (from the
    model type, `dtype`, hidden/heads and the stepstream tokenizer); the rest of the
    config is written as given. vocab_size must cover the tokenizer (>= 8192).
    Same seed: same bytes.
    """
    config = complete_config(config, dtype)
    generator = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config)
    tensors = {}
    for name, shape in shapes.items():  # NOTE: fixed order, so the same seed gives the same weights
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
            if perturb:  # unit norms hide bugs (a norm applied twice, or not at all)
                tensor += 0.1 * torch.randn(shape, generator=generator)
        else:  # matrices and biases: zero biases would hide bugs too, so they are drawn
            tensor = 0.02 * torch.randn(shape, generator=generator)
            if name.endswith(".bias") and not perturb:
                tensor.zero_()
        tensors[name] = tensor.to(getattr(torch, dtype)).contiguous()

    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    })
    for file_name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS_DIR / file_name, out_dir / file_name)
    return str(out_dir)


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama-family checkpoint, in a fixed order."""
    model_type = config["model_type"]
    hidden = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    inter = config["intermediate_size"]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    # Which projections carry biases differs by family (see each HF modeling file).
    attention_bias = model_type in ("llama", "qwen3") and config.get("attention_bias", False)
    qkv_bias = model_type == "qwen2" or attention_bias
    mlp_bias = model_type == "llama" and config.get("mlp_bias", False)

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for proj, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (size, hidden)
            if qkv_bias:
                shapes[p + f"self_attn.{proj}_proj.bias"] = (size,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
        if attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if model_type == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for proj, out_size, in_size in (("gate", inter, hidden), ("up", inter, hidden),
                                        ("down", hidden, inter)):
            shapes[p + f"mlp.{proj}_proj.weight"] = (out_size, in_size)
            if mlp_bias:
                shapes[p + f"mlp.{proj}_proj.bias"] = (out_size,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def num_parameters(config: dict) -> int:
    total = 0
    for shape in checkpoint_shapes(config).values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
