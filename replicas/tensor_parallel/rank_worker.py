"""A rank other than 0: its shard of the model and of the KV cache, running each
forward rank 0 sends, until rank 0 says stop or is gone.

Started by `rank_processes.py` (a process per rank: the offline engine, tests) or
as a Ray actor in the engine replica's placement group (cluster/transport/rank_actors.py).
"""
from __future__ import annotations

import logging

import torch

from replicas.config import EngineConfig
from replicas.tensor_parallel import rank_group
from replicas.tensor_parallel.shard import local_model_config, parallel_layers_, rank_layout
from replicas.tensor_parallel.step_plan import SHUTDOWN, PlanReader

logger = logging.getLogger("stepstream")


def run_rank(rank: int, world: int, address: str, config: EngineConfig, model_dir: str,
             max_model_len: int) -> None:
    """`config` is rank 0's, resolved (dtype and quantization, not auto)."""
    from replicas.kv_cache.memory_profile import allocate_kv_caches
    from replicas.model_runner import select_backend
    from replicas.models.loader import load_model
    from replicas.models.model_config import ModelConfig
    from replicas.models.packed_linear import pack_linears

    torch.set_num_threads(config.num_threads or 1)
    device = torch.device(config.device)
    model_config = ModelConfig.from_dir(model_dir)
    layout = rank_layout(model_config, rank, world)
    model = load_model(model_dir, config.dtype, device,
                       max_model_len + config.num_scheduler_steps + 1,
                       quantization=config.quantization, layout=layout)
    rank_group.join(address, rank, world, device)
    try:
        parallel_layers_(model, layout, model_config.vocab_size)
        if device.type == "cpu":
            pack_linears(model, batch_size_hint=min(config.max_num_seqs, 256))
        backend = select_backend(config, device)
        num_blocks = rank_group.receive()
        kv_caches = allocate_kv_caches(num_blocks, config.block_size,
                                       local_model_config(model_config, layout),
                                       getattr(torch, config.dtype), device)
        reader = PlanReader(device)
        with torch.inference_mode():
            while True:
                plan = rank_group.receive()
                if plan == SHUTDOWN:
                    break
                input_ids, positions, meta, logits_indices = reader.forward_args(plan)
                model(input_ids, positions, kv_caches, meta, backend, logits_indices)
    finally:
        rank_group.leave()


def main(argv: list[str]) -> None:
    """`python -m replicas.tensor_parallel.rank_worker SPEC` (rank_processes.rank_command)."""
    import json
    spec = json.loads(argv[0])
    config = EngineConfig(**spec["config"])
    run_rank(spec["rank"], spec["world"], spec["address"], config, spec["model_dir"],
             spec["max_model_len"])


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
