"""A Llama model whose matrices come straight from a GGUF file, still quantized.

Each projection's tensors repack losslessly into a kernel layout
(replicas/quant/gguf_blocks.py) and run through QuantLinear; the token embedding
stays quantized too and serves a tied lm-head from the same bytes. What is not a
block type the kernels read (float matrices, types without a row in the table)
is dequantized to the run's dtype as before, layer by layer. The small float
tensors (norms) come from the converted directory's safetensors, one by one,
so the float32 copy of the matrices is never read.
"""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
from torch import nn

from replicas.gguf.llama_layout import unpermute_rows
from replicas.gguf.reader import GgufFile, read_gguf
from replicas.models.llama import LlamaForCausalLM
from replicas.models.model_config import ModelConfig
from replicas.quant.gguf_blocks import BLOCK_TYPES, repack
from replicas.quant.layouts import QuantizedWeight, stack_runs
from replicas.quant.linear import QuantEmbedding, QuantLinear

logger = logging.getLogger("stepstream")


class _GgufMatrices:
    """The file's matrices under llama.cpp names, as kernel layouts or float tensors."""

    def __init__(self, checkpoint: GgufFile, cfg: ModelConfig, dtype: torch.dtype):
        self.checkpoint, self.cfg, self.dtype = checkpoint, cfg, dtype
        self.float_types: Counter[str] = Counter()

    def _row_order(self, name: str) -> np.ndarray | None:
        """llama.cpp interleaves q/k rows per head: the HF order of the file's rows."""
        heads = (self.cfg.num_heads if ".attn_q." in name else
                 self.cfg.num_kv_heads if ".attn_k." in name else None)
        if heads is None:
            return None
        rows = self.checkpoint.tensors[name].shape[0]
        return unpermute_rows(np.arange(rows)[:, None], heads)[:, 0]

    def is_native(self, name: str) -> bool:
        tensor = self.checkpoint.tensors[name]
        return tensor.type_name in BLOCK_TYPES and tensor.shape[1] % BLOCK_TYPES[
            tensor.type_name].values == 0

    def quantized(self, name: str) -> QuantizedWeight:
        tensor = self.checkpoint.tensors[name]
        weight = repack(tensor.type_name, tensor.data, tensor.shape)
        order = self._row_order(name)
        return weight if order is None else weight.select_rows(order)

    def dense(self, name: str) -> torch.Tensor:
        import gguf

        tensor = self.checkpoint.tensors[name]
        self.float_types[tensor.type_name] += 1
        values = np.asarray(gguf.dequantize(tensor.data, tensor.qtype), dtype=np.float32)
        order = self._row_order(name)
        if order is not None:
            values = values[order]
        return torch.from_numpy(np.ascontiguousarray(values)).to(self.dtype)

    def linear(self, names: list[str]) -> nn.Module:
        """One layer over the rows of `names`: a QuantLinear when every one is a
        native type, else an nn.Linear of their dequantized values."""
        if all(self.is_native(n) for n in names):
            return QuantLinear(stack_runs([self.quantized(n) for n in names]))
        weight = torch.cat([self.dense(n) for n in names])
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer


def load_gguf_model(model_dir: str, gguf_path: str, dtype: torch.dtype, max_positions: int
                    ) -> LlamaForCausalLM:
    """The model of the converted directory `model_dir`, its matrices from `gguf_path`."""
    from safetensors import safe_open

    cfg = ModelConfig.from_dir(model_dir)
    matrices = _GgufMatrices(read_gguf(gguf_path), cfg, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    embed_name = "token_embd.weight"
    if matrices.is_native(embed_name):
        embedding = matrices.quantized(embed_name)
        model.embed_tokens = QuantEmbedding(embedding, dtype)
        lm_head = QuantLinear([embedding]) if cfg.tie_word_embeddings else None
    else:
        model.embed_tokens = nn.Embedding.from_pretrained(matrices.dense(embed_name), freeze=True)
        lm_head = model.embed_tokens if cfg.tie_word_embeddings else None
    if lm_head is None:
        model.lm_head = matrices.linear(["output.weight"])
    elif isinstance(lm_head, nn.Embedding):
        model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        model.lm_head.weight = lm_head.weight
    else:
        model.lm_head = lm_head
    for i, layer in enumerate(model.layers):
        blk = f"blk.{i}."
        attn = layer.self_attn
        attn.qkv_proj = matrices.linear([blk + "attn_q.weight", blk + "attn_k.weight",
                                         blk + "attn_v.weight"])
        attn.o_proj = matrices.linear([blk + "attn_output.weight"])
        layer.mlp.gate_up_proj = matrices.linear([blk + "ffn_gate.weight", blk + "ffn_up.weight"])
        layer.mlp.down_proj = matrices.linear([blk + "ffn_down.weight"])
    # NOTE: only what is still on the meta device is allocated here: norms, rope tables
    small = [name for name, param in model.named_parameters() if param.is_meta]
    _materialize_meta(model, dtype)
    params = dict(model.named_parameters())
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as floats:
        for name in small:
            params[name].data.copy_(floats.get_tensor("model." + name).to(dtype))
    model.rope.build(cfg, max_positions, torch.device("cpu"))
    if matrices.float_types:
        logger.info("GGUF matrices of types %s run dequantized to %s (no quantized kernel "
                    "reads them)", dict(matrices.float_types), str(dtype).removeprefix("torch."))
    return model.eval()


def _materialize_meta(model: nn.Module, dtype: torch.dtype) -> None:
    """Allocate every parameter and buffer still on the meta device, in place."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=dtype),
                                                   requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)
