"""How a Llama-family model splits across `world` ranks, and the split itself.

Per rank: a slice of the query heads and the KV heads they read (KV heads
replicated where there are fewer than ranks: each rank keeps the one its query
heads use), a slice of the MLP's intermediate size; q/k/v and gate/up split by
output (column-parallel), o and down by input (row-parallel, one all-reduce each
per layer); the lm-head split by vocabulary, its logits gathered for sampling;
the embedding replicated (a lookup: nothing to add up).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from replicas.models.model_config import ModelConfig


@dataclasses.dataclass(frozen=True, slots=True)
class RankLayout:
    rank: int
    world: int
    q_heads: tuple[int, int]  # [start, end) of the model's query heads
    kv_heads: tuple[int, int]  # [start, end) of its KV heads
    intermediate: tuple[int, int]  # [start, end) of the MLP's intermediate size
    vocab: tuple[int, int]  # [start, end) of the lm-head's rows (the last may be short)
    vocab_per_rank: int  # every rank's share, padded: the gathered logits' width / world


def rank_layout(cfg: ModelConfig, rank: int, world: int) -> RankLayout:
    """Raises ValueError (one line, naming the numbers) where the model cannot split."""
    H, KV, I = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if H % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's "
                         f"{H} attention heads")
    if KV >= world and KV % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's "
                         f"{KV} KV heads")
    if KV < world and world % KV:
        raise ValueError(f"the model's {KV} KV heads cannot be replicated evenly over "
                         f"tensor_parallel_size {world} ranks")
    if I % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's "
                         f"intermediate size {I}")
    q_per = H // world
    if KV >= world:
        kv_per = KV // world
        kv = (rank * kv_per, (rank + 1) * kv_per)
    else:
        kv0 = rank // (world // KV)
        kv = (kv0, kv0 + 1)
    i_per = I // world
    v_per = -(-cfg.vocab_size // world)
    vocab = (min(rank * v_per, cfg.vocab_size), min((rank + 1) * v_per, cfg.vocab_size))
    return RankLayout(rank, world, (rank * q_per, (rank + 1) * q_per), kv,
                      (rank * i_per, (rank + 1) * i_per), vocab, v_per)


def local_model_config(cfg: ModelConfig, layout: RankLayout) -> ModelConfig:
    """The config of one rank's shard (its KV cache's shape)."""
    return dataclasses.replace(cfg, num_heads=layout.q_heads[1] - layout.q_heads[0],
                               num_kv_heads=layout.kv_heads[1] - layout.kv_heads[0],
                               intermediate_size=layout.intermediate[1] - layout.intermediate[0])


class RowParallel(nn.Module):
    """A row-split linear: each rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Linear, group) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        out = self.linear(x)
        # NOTE: summed in float32 (gloo has no bfloat16 sum everywhere, and the
        # partial products keep more of their bits)
        total = out.float() if out.dtype != torch.float32 else out
        dist.all_reduce(total, group=self.group)
        return total if total is out else total.to(out.dtype)


class VocabParallelHead(nn.Module):
    """A vocabulary-split lm-head: each rank's logits, gathered into the full row."""

    def __init__(self, linear: nn.Linear, vocab_size: int, vocab_per_rank: int, group) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.vocab_per_rank = vocab_per_rank
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        local = self.linear(x).float()
        if local.shape[-1] < self.vocab_per_rank:  # the last rank's short share
            local = torch.nn.functional.pad(local, (0, self.vocab_per_rank - local.shape[-1]))
        world = dist.get_world_size(self.group)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return linear


def shard_llama_(model: nn.Module, layout: RankLayout, group) -> nn.Module:
    """Keep only `layout`'s shard of `model`'s float weights (in place)."""
    cfg = model.config
    if any(type(m) is not nn.Linear for layer in model.layers
           for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)):
        raise ValueError("tensor_parallel_size > 1 runs float weights: set quantization none")
    D, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_size, kv_size = H * D, KV * D
    (q0, q1), (k0, k1), (i0, i1) = layout.q_heads, layout.kv_heads, layout.intermediate
    q_rows = slice(q0 * D, q1 * D)
    k_rows = slice(q_size + k0 * D, q_size + k1 * D)
    v_rows = slice(q_size + kv_size + k0 * D, q_size + kv_size + k1 * D)
    I = cfg.intermediate_size
    with torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            attn.qkv_proj = _linear(torch.cat([w[q_rows], w[k_rows], w[v_rows]]),
                                    None if b is None else torch.cat([b[q_rows], b[k_rows], b[v_rows]]))
            attn.o_proj = RowParallel(_linear(attn.o_proj.weight[:, q0 * D:q1 * D], None), group)
            attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
            attn.q_size, attn.kv_size = (q1 - q0) * D, (k1 - k0) * D
            w = mlp.gate_up_proj.weight
            mlp.gate_up_proj = _linear(torch.cat([w[i0:i1], w[I + i0:I + i1]]), None)
            mlp.down_proj = RowParallel(_linear(mlp.down_proj.weight[:, i0:i1], None), group)
            mlp.intermediate_size = i1 - i0
        v0, v1 = layout.vocab
        model.lm_head = VocabParallelHead(_linear(model.lm_head.weight[v0:v1].clone(), None),
                                          cfg.vocab_size, layout.vocab_per_rank, group)
    return model
