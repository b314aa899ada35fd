"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k
norm) over a flattened batch of tokens and a paged KV cache.

Shapes: T = tokens in the step (prefill chunks first, then one per decode).
q/k/v projections and gate/up are fused at load time: one matmul each on CPU.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from replicas.attention.base import AttentionBackend, AttentionMetadata
from replicas.models.bf16_layer_ops import load_bf16_layer_ops
from replicas.models.layers import LayerOps, RMSNorm, RotaryEmbedding
from replicas.models.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, ops: LayerOps | None = None) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        cos, sin = rope_tables
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and ops is not None:
            q, k = ops.rotary(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        elif self.q_norm is None:
            # NOTE: q and k sit side by side in qkv: one rotary pass over both heads
            qk = qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads,
                                                          self.head_dim)
            qk = RotaryEmbedding.rotate(qk, cos, sin)
            # NOTE: contiguous, as every backend has always been given them
            q, k = qk[:, :self.num_heads].contiguous(), qk[:, self.num_heads:].contiguous()
        else:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
            q, k = RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)  # (T, heads, head_dim)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        # NOTE: an uninitialised weight (the loader copies the checkpoint's in): a random
        # init on the meta device goes through torch's reference ops, whose import of
        # torch._dynamo costs every engine start more than a second.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg, max_positions)
        # NOTE: a switch for benchmarks, which run torch's operators beside the kernel
        self.native_layer_ops = True

    def layer_ops(self, h: torch.Tensor) -> LayerOps | None:
        """The C kernel's layer ops for bfloat16 activations on a CPU, the Triton kernels'
        for bfloat16 and float16 on CUDA, where they build; else None (torch operators)."""
        if not self.native_layer_ops:
            return None
        if h.device.type == "cpu" and h.dtype == torch.bfloat16:
            return load_bf16_layer_ops()[0]
        if h.device.type == "cuda" and h.dtype in (torch.bfloat16, torch.float16):
            return cuda_layer_ops(h.device, h.dtype)
        return None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, logits_indices: torch.Tensor | None,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """(T,) ids -> (num_sampled, vocab) float32 logits of the rows in logits_indices,
        written into `logits_out` when given (float32, of that shape)."""
        h = self.embed_tokens(input_ids)
        ops = self.layer_ops(h)
        rope_tables = self.rope.tables(positions, h.dtype)
        # NOTE: each residual add happens in the next norm's pass (one pass with the kernel)
        mlp_out = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            normed, h = layer.input_layernorm.add_forward(h, mlp_out, ops)
            attn = layer.self_attn(normed, rope_tables, kv_cache, meta, backend, ops)
            normed, h = layer.post_attention_layernorm.add_forward(h, attn, ops)
            mlp_out = layer.mlp(normed, ops)
        if mlp_out is not None:
            h = h + mlp_out
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)  # only the rows we sample from
        normed = self.norm.add_forward(h, None, ops)[0]
        logits = self.lm_head(normed)
        if logits_out is None:
            return logits.float()
        return logits_out.copy_(logits)


def cuda_layer_ops(device: torch.device, dtype: torch.dtype) -> LayerOps | None:
    """The Triton layer ops, compiled and checked once per device and dtype; None where
    Triton does not import or the kernels fail their check (logged once)."""
    try:
        from replicas.models.triton_layer_ops import load_triton_layer_ops
    except ImportError:  # torch without Triton: its own operators
        return None
    return load_triton_layer_ops(device, dtype)[0]
