"""This machine's processes as /proc lists them: parent, name, start time and CPU
time of each, and the tree below one of them. Linux only. Torch- and Ray-free.

Used by the launcher's watchdog (cluster/launcher/process_reaper.py) and by the serving
benchmark's CPU accounting (loadtests/serving/process_cpu.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(slots=True, frozen=True)
class ProcessInfo:
    ppid: int
    comm: str
    start_ticks: int  # since boot: with the pid, names one process (pids are reused)
    cpu_s: float  # user + system, all threads


def read_process(pid: int) -> ProcessInfo | None:
    """One live process, or None."""
    return _read_stat(f"/proc/{pid}/stat")


def read_thread(pid: int, tid: int) -> ProcessInfo | None:
    """One live thread of `pid` (its own name and CPU time), or None."""
    return _read_stat(f"/proc/{pid}/task/{tid}/stat")


def _read_stat(path: str) -> ProcessInfo | None:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # NOTE: comm sits in parentheses and may hold spaces or ')': split at the last ')'.
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return ProcessInfo(int(fields[1]), comm, int(fields[19]),
                       (int(fields[11]) + int(fields[12])) / _CLK_TCK)


def read_process_table() -> dict[int, ProcessInfo]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_process(int(name))
            if info is not None:
                table[int(name)] = info
    return table


def descendants(table: dict[int, ProcessInfo], root_pid: int) -> list[int]:
    """The pids below `root_pid` (not itself) in `table`."""
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    out, seen, todo = [], set(), list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            out.append(pid)
            todo += children.get(pid, [])
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""
