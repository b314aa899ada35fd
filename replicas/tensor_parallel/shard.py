"""How a Llama-family model splits across `world` ranks, and its collectives.

Per rank: a slice of the query heads and the KV heads they read (KV heads
replicated where there are fewer than ranks: each rank keeps the one its query
heads use), a slice of the MLP's intermediate size; q/k/v and gate/up split by
output (column-parallel), o and down by input (row-parallel, one all-reduce each
per layer); the lm-head split by vocabulary, its logits gathered for sampling;
the embedding replicated (a lookup: nothing to add up). Each rank reads only its
slices of the checkpoint (replicas/models/loader.py, given its `RankLayout`).
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


def parallel_layers_(model: nn.Module, layout: RankLayout, vocab_size: int, group=None
                     ) -> nn.Module:
    """A rank's shard (loaded as such: replicas/models/loader.py) with its collectives:
    o_proj and down_proj add up over the ranks, the lm-head's rows are gathered."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    model.lm_head = VocabParallelHead(model.lm_head, vocab_size, layout.vocab_per_rank, group)
    return model
