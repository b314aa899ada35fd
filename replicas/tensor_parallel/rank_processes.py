"""The other ranks as local processes: the offline engine's and the tests' way.
Serve's engine replicas start them as Ray actors in their placement group instead
(`set_rank_starter`).

NOTE: a fresh interpreter per rank (`python -m replicas.tensor_parallel.rank_worker`),
not multiprocessing's spawn, which runs the caller's main module again (a script
without a `__main__` guard would start engines recursively). Each dies with its
parent (Linux's parent-death signal), so no rank outlives the engine that started it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import signal
import subprocess
import sys
from typing import Callable, Protocol

from replicas.config import EngineConfig


class Ranks(Protocol):
    def stop(self, timeout_s: float) -> None: ...


# (world, address, config, model_dir, max_model_len) -> the started ranks 1..world-1
RankStarter = Callable[[int, str, EngineConfig, str, int], Ranks]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the collectives' timeout ends it instead
        pass


def rank_command(rank: int, world: int, address: str, config: EngineConfig, model_dir: str,
                 max_model_len: int) -> list[str]:
    spec = {"rank": rank, "world": world, "address": address, "model_dir": model_dir,
            "max_model_len": max_model_len, "config": dataclasses.asdict(config)}
    return [sys.executable, "-m", "replicas.tensor_parallel.rank_worker", json.dumps(spec)]


class LocalRanks:
    def __init__(self, world: int, address: str, config: EngineConfig, model_dir: str,
                 max_model_len: int) -> None:
        self.processes = [subprocess.Popen(rank_command(rank, world, address, config,
                                                        model_dir, max_model_len),
                                           preexec_fn=_die_with_parent)
                          for rank in range(1, world)]

    def stop(self, timeout_s: float) -> None:
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)


_starter: RankStarter = LocalRanks


def set_rank_starter(starter: RankStarter | None) -> None:
    """How this process starts the other ranks of its engines (None: local processes)."""
    global _starter
    _starter = starter or LocalRanks


def start_ranks(world: int, address: str, config: EngineConfig, model_dir: str,
                max_model_len: int) -> Ranks:
    return _starter(world, address, config, model_dir, max_model_len)
