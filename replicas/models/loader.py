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


class _Checkpoint:
    """A directory's safetensors, read tensor by tensor, or a slice of one: a rank of a
    split model reads its own rows and columns only, never the whole model."""

    def __init__(self, model_dir: str) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise ValueError(f"model directory {model_dir!r} has no *.safetensors files")
        self._files = [safe_open(path, framework="pt") for path in files]
        self._where = {name: f for f in self._files for name in f.keys()}
        self._taken: set[str] = set()

    def take(self, name: str, rows: slice | None = None, cols: slice | None = None,
             model_dir: str = "") -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"checkpoint in {model_dir!r} lacks weight {name!r}")
        self._taken.add(name)
        if rows is None and cols is None:
            return self._where[name].get_tensor(name)
        part = self._where[name].get_slice(name)
        if cols is None:
            return part[rows]
        return part[rows or slice(None), cols]

    def left(self) -> list[str]:
        return [n for n in self._where if n not in self._taken]


def load_model(model_dir: str, dtype: str, device: torch.device, max_positions: int,
               quantization: str = "none", layout=None) -> LlamaForCausalLM:
    """The model, its weights as `quantization` says (replicas/quant/choice.py; resolved):
    gguf keeps a GGUF file's quantized matrices, int8/int4 quantize float weights.
    `layout` (replicas/tensor_parallel/shard.py's RankLayout): one rank's shard only,
    read as such from the checkpoint (float weights)."""
    if layout is not None:
        if quantization != "none":
            raise ValueError("tensor_parallel_size > 1 runs float weights: set quantization none")
        return _load_float_model(model_dir, dtype, device, max_positions, layout)
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


def _load_float_model(model_dir: str, dtype: str, device: torch.device, max_positions: int,
                      layout=None) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    checkpoint = _Checkpoint(model_dir)
    torch_dtype = _DTYPES[dtype]
    # NOTE: a rank's shard is a model of its own heads and intermediate size, its
    # lm-head its rows of the vocabulary (replicas/tensor_parallel/shard.py)
    split = layout is not None
    model_cfg = cfg
    if split:
        from replicas.tensor_parallel.shard import local_model_config
        model_cfg = local_model_config(cfg, layout)
    with torch.device("meta"):
        model = LlamaForCausalLM(model_cfg, max_positions)
        if split:
            v0, v1 = layout.vocab
            model.lm_head = torch.nn.Linear(cfg.hidden_size, v1 - v0, bias=False)
    model = model.to_empty(device=device).to(torch_dtype)

    def take(name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        return checkpoint.take(name, rows, cols, model_dir)

    D, I = cfg.head_dim, cfg.intermediate_size
    q_rows = kv_rows = o_cols = i_rows = vocab_rows = None
    if split:
        (q0, q1), (k0, k1), (i0, i1) = layout.q_heads, layout.kv_heads, layout.intermediate
        q_rows, kv_rows, o_cols = slice(q0 * D, q1 * D), slice(k0 * D, k1 * D), slice(q0 * D, q1 * D)
        i_rows, vocab_rows = slice(i0, i1), slice(*layout.vocab)
    state: dict[str, torch.Tensor] = {"embed_tokens.weight": take("model.embed_tokens.weight"),
                                      "norm.weight": take("model.norm.weight")}
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{n}_proj.weight", rows[n]) for n in "qkv"])
        if cfg.attention_bias:
            state[ours + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + f"{n}_proj.bias", rows[n]) for n in "qkv"])
        state[ours + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight", None, o_cols)
        if cfg.qk_norm:
            state[ours + "self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
            state[ours + "self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight", i_rows), take(hf + "mlp.up_proj.weight", i_rows)])
        state[ours + "mlp.down_proj.weight"] = take(hf + "mlp.down_proj.weight", None, i_rows)
        state[ours + "input_layernorm.weight"] = take(hf + "input_layernorm.weight")
        state[ours + "post_attention_layernorm.weight"] = take(hf + "post_attention_layernorm.weight")
    tied = cfg.tie_word_embeddings
    if split:  # a rank's rows of the head: of the embedding where the two are tied
        state["lm_head.weight"] = take("model.embed_tokens.weight" if tied else "lm_head.weight",
                                       vocab_rows)
    elif not tied:
        state["lm_head.weight"] = take("lm_head.weight")
    # NOTE: ignore rotary caches some checkpoints carry (and a tied head's copy); anything
    # else is a bug.
    leftover = [n for n in checkpoint.left()
                if "rotary_emb" not in n and not (tied and n == "lm_head.weight")]
    if leftover:
        raise ValueError(f"unexpected weights in {model_dir!r}: {leftover[:5]}")
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and tied and not split:
            continue
        param.data.copy_(state.pop(name).to(torch_dtype))
    if state:
        raise ValueError(f"weights without a place in the model: {list(state)[:5]}")
    # the rope tables were lost on meta: rebuild them in float32 on the device
    model.rope.build(cfg, max_positions, device)
    if tied and not split:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()
