"""CPU seconds by server process role over a benchmark run, read from /proc (Linux
only; elsewhere `available` is False and the table is empty). The roles and what
`bench --server-pid` prints: loadtests/README.md ("Where the CPU goes").
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from cluster.launcher.process_table import (ProcessInfo, cmdline, descendants, read_process_table,
                                            read_thread)

ROLES = ("front door", "ingress", "engine", "ray", "client")
# Part of "engine", not beside it: the engine replicas' step threads alone (by the
# name the engine gives them). The rest of "engine" is the replicas' other threads:
# their output and event-loop threads and Ray's own. Left out of a run whose server
# names no step thread (an older revision's): 0 there would read as a measurement.
ENGINE_STEP = "engine step"
# replicas.os_thread_name.ENGINE_STEP_THREAD (a test keeps them equal): the HTTP
# clients import neither replicas nor Ray.
ENGINE_STEP_THREAD = "ss-engine-step"
SHOWN = (*ROLES[:3], ENGINE_STEP, *ROLES[3:])  # the order of the printed CPU block


def role_of(cmdline: str, comm: str) -> str:
    if ("ProxyActor" in cmdline or "HAProxyManager" in cmdline or comm == "haproxy"
            or cmdline.split(" ")[0].endswith("/haproxy")):
        return "front door"
    if cmdline.startswith("ray::ServeReplica:") and cmdline.endswith(":Ingress"):
        return "ingress"
    if cmdline.startswith("ray::ServeReplica:") and cmdline.endswith(":EngineReplica"):
        return "engine"
    return "ray"


def processes(root_pid: int | None) -> list[tuple[int, str, str, ProcessInfo]]:
    """(pid, command line, role, process info) of root_pid and everything below it,
    or of every process here when root_pid is None."""
    table = read_process_table()
    pids = [root_pid, *descendants(table, root_pid)] if root_pid is not None else list(table)
    out = []
    for pid in pids:
        info = table.get(pid)
        if info is not None:  # gone meanwhile
            command = cmdline(pid)
            out.append((pid, command, role_of(command, info.comm), info))
    return out


def _step_threads(pid: int) -> dict[int, float]:
    """tid -> CPU seconds of `pid`'s engine step threads (none where unnamed)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    out = {}
    for tid in tids:
        info = read_thread(pid, tid)
        if info is not None and info.comm == ENGINE_STEP_THREAD:
            out[tid] = info.cpu_s
    return out


def _cpu_by_process(root_pid: int) -> dict[tuple, tuple[str, float]]:
    """(pid, start time[, tid]) -> (role, CPU seconds).
    NOTE: keyed with the start time too: a pid reused during a run is another process."""
    out = {}
    for pid, _, role, info in processes(root_pid):
        out[(pid, info.start_ticks)] = (role, info.cpu_s)
        if role == "engine":
            for tid, cpu in _step_threads(pid).items():
                out[(pid, info.start_ticks, tid)] = (ENGINE_STEP, cpu)
    return out


@dataclass(slots=True)
class ProcessCpu:
    """CPU seconds per role between `start()` and `take()`."""
    root_pid: int
    available: bool = field(default_factory=lambda: os.path.isdir("/proc/self"))
    # (pid, start time) per process, (pid, start time, tid) per engine step thread
    _before: dict[tuple, tuple[str, float]] = field(default_factory=dict)
    _client_before: float = 0.0

    def start(self) -> "ProcessCpu":
        if self.available:
            self._before = _cpu_by_process(self.root_pid)
            self._client_before = _own_cpu_s()
        return self

    def take(self) -> dict[str, float]:
        """Seconds per role since start(); processes that started meanwhile count
        from 0, those that ended meanwhile are lost (none should, in a run)."""
        if not self.available:
            return {}
        seconds = dict.fromkeys(SHOWN, 0.0)
        now = _cpu_by_process(self.root_pid)
        for key, (role, cpu) in now.items():
            before = self._before.get(key)
            seconds[role] += cpu - (before[1] if before is not None else 0.0)
        seconds["client"] = _own_cpu_s() - self._client_before
        if not any(role == ENGINE_STEP for role, _ in (*now.values(), *self._before.values())):
            del seconds[ENGINE_STEP]
        return seconds


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def per_token_us(seconds: dict[str, float], num_output_tokens: int) -> dict[str, float]:
    """CPU microseconds per output token for each role (and their server total)."""
    if not seconds or num_output_tokens <= 0:
        return {}
    out = {role: s * 1e6 / num_output_tokens for role, s in seconds.items()}
    out["server"] = sum(v for role, v in out.items() if role not in ("client", ENGINE_STEP))
    return out

