"""How the local launcher splits a CPU machine's cores between engine replicas and
the HTTP side, when the command line and the config leave it open.

Why not one engine replica with every core as torch threads: each decode step of a
small model is a few hundred small matrix products, and intra-op threads meet at a
barrier after each one. On a machine the HTTP side shares (ingress, front door,
Ray), a wakeup there preempts one thread and the others wait for it. Engine
replicas of one thread each share nothing: a preempted one delays only its own
streams, and the ingress spreads requests over them. On two cores, two one-thread
replicas served the trained preset faster than the offline engine with two threads
(docs/performance.md, "Engine replicas on a CPU machine").

Past a few cores the rule keeps replicas of a few threads each (every replica holds
its own weights and KV cache, and fewer, larger batches use the matrix units
better), leaves one core per ingress replica, and adds an ingress replica per 16
cores (one ingress is one Python event loop: about one core of HTTP work).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# Up to this many cores: one engine replica of one thread per core.
ONE_PER_CORE_UP_TO = 4
# Beyond: at least two engine replicas, and one per this many free cores.
CPUS_PER_REPLICA = 4
CORES_PER_INGRESS = 16
INGRESS_NUM_CPUS = 0.5  # AppArgs.ingress_num_cpus's default (kept equal by a test)

# The AppArgs fields the layout sets; any of them set by the user (or autoscaling, or
# a GPU) leaves the whole layout to the user.
LAYOUT_FIELDS = ("num_engine_replicas", "engine_num_cpus", "num_ingress_replicas",
                 "num_threads", "autoscaling", "engine_num_gpus")


@dataclass(frozen=True, slots=True)
class CpuLayout:
    cores: int
    num_engine_replicas: int
    engine_num_cpus: int
    num_ingress_replicas: int

    def app_args(self) -> dict:
        return {"num_engine_replicas": self.num_engine_replicas,
                "engine_num_cpus": float(self.engine_num_cpus),
                "num_ingress_replicas": self.num_ingress_replicas}

    def describe(self) -> str:
        engines = (f"{self.num_engine_replicas} engine replica"
                   f"{'s' if self.num_engine_replicas != 1 else ''} of "
                   f"{self.engine_num_cpus} CPU{'s' if self.engine_num_cpus != 1 else ''}")
        ingress = (f"{self.num_ingress_replicas} ingress replica"
                   f"{'s' if self.num_ingress_replicas != 1 else ''}")
        return f"{engines}, {ingress} on {self.cores} core{'s' if self.cores != 1 else ''}"


def cpu_layout(cores: int) -> CpuLayout:
    """The layout for a machine of `cores` usable cores (at least 1)."""
    cores = max(1, int(cores))
    if cores <= ONE_PER_CORE_UP_TO:
        return CpuLayout(cores, cores, 1, 1)
    ingresses = max(1, cores // CORES_PER_INGRESS)
    free = cores - ingresses
    replicas = max(2, free // CPUS_PER_REPLICA)
    return CpuLayout(cores, replicas, free // replicas, ingresses)


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the
    machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def layout_for(args: dict, cores: int | None = None,
               ray_cpus: float | None = None) -> CpuLayout | None:
    """The layout to apply to AppArgs values `args` (from the config and the flags),
    or None when they choose one themselves or the engine runs on a GPU. `ray_cpus`:
    the local Ray's logical CPUs when the user fixed them (--num-cpus): the replicas
    must fit in them, or Serve would wait forever for the ones that do not."""
    if any(args.get(name) is not None for name in LAYOUT_FIELDS):
        return None
    if args.get("device") not in (None, "cpu"):
        return None
    layout = cpu_layout(usable_cores() if cores is None else cores)
    # NOTE: a replica of N tensor-parallel ranks takes a bundle of engine_num_cpus per rank
    ranks = args.get("tensor_parallel_size") or 1
    if ranks > 1:
        layout = CpuLayout(layout.cores, max(1, layout.num_engine_replicas // ranks),
                           layout.engine_num_cpus, layout.num_ingress_replicas)
    if ray_cpus is None:
        return layout
    ingress_cpus = layout.num_ingress_replicas * args.get("ingress_num_cpus", INGRESS_NUM_CPUS)
    fits = int((ray_cpus - ingress_cpus) // (layout.engine_num_cpus * ranks))
    return CpuLayout(layout.cores, max(1, min(layout.num_engine_replicas, fits)),
                     layout.engine_num_cpus, layout.num_ingress_replicas)
