"""The ranks of one engine replica: their process group, and how plans reach them.

gloo on CPU (NCCL on CUDA), rendezvous at rank 0's address. Collectives time out
(`COLLECTIVE_TIMEOUT_S`): a rank that died or hangs fails the step that waits on
it, and the engine's health check then fails the replica, never the suite or a
caller forever.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 60.0


def rendezvous_address() -> str:
    """tcp://<this host>:<a free port>, for the other ranks to join."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    host = "127.0.0.1"
    try:
        import ray
        if ray.is_initialized():
            host = ray.util.get_node_ip_address()
    except Exception:
        pass
    return f"tcp://{host}:{port}"


def join(address: str, rank: int, world: int, device: torch.device,
         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the group (blocks until every rank joined, or the timeout)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def send(obj) -> None:
    """Rank 0: one object to every other rank."""
    dist.broadcast_object_list([obj], src=0)


def receive():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
