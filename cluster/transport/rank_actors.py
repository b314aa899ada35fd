"""An engine replica's other ranks (tensor_parallel_size > 1) as Ray actors, one
per bundle of the replica's placement group (bundle 0 is the replica itself, rank 0).

Each actor runs its rank until rank 0 stops it or is gone
(replicas/tensor_parallel/rank_worker.py). The actors are the replica's own (not
detached): Ray ends them with it, so no rank outlives its replica, and a redeploy
or drain that stops the replica releases its placement group. Torch is imported
in the actors only, never here.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")


class _RankActor:
    def run(self, rank: int, world: int, address: str, config, model_dir: str,
            max_model_len: int) -> None:
        from replicas.tensor_parallel.rank_worker import run_rank
        run_rank(rank, world, address, config, model_dir, max_model_len)


class RayRanks:
    """`replicas.tensor_parallel.rank_processes.RankStarter` on Ray."""

    def __init__(self, world: int, address: str, config, model_dir: str,
                 max_model_len: int) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = get_current_placement_group()
        actor_class = ray.remote(_RankActor)
        on_gpu = config.device.startswith("cuda")
        self.actors, self.runs = [], []
        for rank in range(1, world):
            options = {"num_cpus": 0, "num_gpus": 1 if on_gpu else 0,
                       "name": None, "max_restarts": 0}
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank)
            actor = actor_class.options(**options).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(rank, world, address, config, model_dir,
                                              max_model_len))

    def stop(self, timeout_s: float) -> None:
        import ray
        _, running = ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)
        if running:
            logger.warning("%d tensor-parallel ranks did not stop in %g s: killed",
                           len(running), timeout_s)
