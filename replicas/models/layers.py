"""The layers a Llama-family model shares with its kernels: the norm, the rotary
embedding and the protocol of a layer's elementwise passes. Here, and not in
llama.py, so that the kernels' checks (triton_layer_ops.py) and the model both
import them, and neither imports the other.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn
import torch.nn.functional as F

from replicas.models.model_config import ModelConfig


class LayerOps(Protocol):
    """A layer's elementwise passes, one kernel each: bf16_layer_ops.Bf16LayerOps (C,
    CPU) or triton_layer_ops.TritonLayerOps (CUDA)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # NOTE: torch's fused op computes exactly the expression below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # NOTE: float32 statistics, as transformers computes them (parity).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                    ops: LayerOps | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), h) with h = x + residual (x when residual is None)."""
        if ops is not None and self.weight.dtype == x.dtype:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        h = x if residual is None else x + residual
        return self(h), h


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(cfg, max_positions, torch.device("cpu"))

    def build(self, cfg: ModelConfig, max_positions: int, device: torch.device) -> None:
        """(Re)compute the float32 tables on `device` (after a meta-device init)."""
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), _inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, head_dim), rotate-half layout
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, (T, 1, head_dim): looked up once per forward,
        shared by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
