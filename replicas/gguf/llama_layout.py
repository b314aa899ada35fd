"""llama.cpp's layout of a Llama checkpoint, mapped back onto Hugging Face's: the
config.json its metadata describes and its tensors under HF names, dequantized to
float32 with the q/k row permutation llama.cpp's converter applies undone.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from replicas.gguf.reader import GgufFile

# llama.cpp name -> HF name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name; None for a name this layout lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"
    return None


def hf_config(checkpoint: GgufFile) -> dict:
    """config.json for the checkpoint, from the `llama.*` and tokenizer metadata."""
    meta = checkpoint.metadata
    arch = checkpoint.architecture

    def need(key: str):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise checkpoint.fail(f"metadata key {arch}.{key} is missing")
        return value

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise checkpoint.fail(f"rotary dimensions {rope_dims} differ from the head size "
                              f"{head_dim} (partial rotary embeddings are not supported)")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise checkpoint.fail(f"rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported")
    vocab_size = meta.get(f"{arch}.vocab_size")
    if vocab_size is None:  # older files: one entry per token
        vocab_size = len(checkpoint.array("tokenizer.ggml.tokens") or [])
    eos_ids = [int(meta[key]) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if key in meta]
    eos_ids = list(dict.fromkeys(eos_ids))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        # NOTE: the float32 values as stored, widened exactly (transformers reads them so)
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in checkpoint.tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in meta else None,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]) if "tokenizer.ggml.padding_token_id" in meta else None,
    }


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: it stores each head's rows interleaved
    (pairs of rotary halves) where HF keeps the two halves apart."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """llama.cpp name -> the (rows, cols) shape the config implies, for every tensor
    a checkpoint of this config has."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (vocab, hidden)
    layer = {"attn_norm.weight": (hidden,), "attn_q.weight": (q_size, hidden),
             "attn_k.weight": (kv_size, hidden), "attn_v.weight": (kv_size, hidden),
             "attn_output.weight": (hidden, q_size), "ffn_norm.weight": (hidden,),
             "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
             "ffn_down.weight": (hidden, inter)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{suffix}": shape for suffix, shape in layer.items()})
    return shapes


def check_tensors(checkpoint: GgufFile, config: dict) -> None:
    """Every tensor the config implies is there with its shape, and nothing else:
    checked before anything is dequantized."""
    if "rope_freqs.weight" in checkpoint.tensors:
        raise checkpoint.fail("Llama 3.1-style rope scaling (tensor rope_freqs.weight) is "
                              "not supported")
    expected = expected_shapes(config)
    unknown = [name for name in checkpoint.tensors if name not in expected]
    if unknown:
        raise checkpoint.fail(f"tensors this Llama layout does not have: {unknown[:5]}")
    missing = [name for name in expected if name not in checkpoint.tensors]
    if missing:
        raise checkpoint.fail(f"tensors missing: {missing[:5]}")
    for name, shape in expected.items():
        if checkpoint.tensors[name].shape != shape:
            raise checkpoint.fail(f"tensor {name} has shape {checkpoint.tensors[name].shape}, "
                                  f"the metadata implies {shape}")


def hf_tensors(checkpoint: GgufFile, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor, in the file's order; check_tensors
    has passed."""
    import gguf

    for name, tensor in checkpoint.tensors.items():
        weight = np.asarray(gguf.dequantize(tensor.data, tensor.qtype), dtype=np.float32)
        if weight.shape != tensor.shape:
            raise checkpoint.fail(f"tensor {name} dequantizes to {weight.shape}, "
                                  f"its header says {tensor.shape}")
        if ".attn_q." in name:
            weight = unpermute_rows(weight, config["num_attention_heads"])
        elif ".attn_k." in name:
            weight = unpermute_rows(weight, config["num_key_value_heads"])
        yield hf_name(name), np.ascontiguousarray(weight)
