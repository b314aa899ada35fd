"""The host memory a CPU engine may still take, read once at start-up.

The CPU KV cache's default size is a share of this (replicas/kv_cache/kv_budget.py),
so that a replica started on a small machine, or beside other replicas on one node,
does not take memory that is not there. A container's limit counts as much as the
machine's: the smaller of the two wins. Pure Python, no torch.
"""
from __future__ import annotations

from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
# cgroup v2 (one file pair), then v1
_CGROUP_LIMITS = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                  (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                   Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
# cgroup v1 writes "no limit" as a huge number near 2**63
_NO_LIMIT = 2**60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def meminfo_available_bytes(meminfo_text: str) -> int | None:
    """MemAvailable from /proc/meminfo's text (kB), None when it is not there."""
    for line in meminfo_text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) >= 2 and fields[1].isdigit() else None
    return None


def cgroup_available_bytes(limit: int | None, used: int | None) -> int | None:
    """What a cgroup's limit leaves, None when it sets none."""
    if limit is None or used is None or limit >= _NO_LIMIT:
        return None
    return max(0, limit - used)


def available_host_bytes() -> int | None:
    """The memory this process may still allocate: the machine's MemAvailable, or
    its container's limit less its use when smaller. None where neither can be read
    (not Linux)."""
    try:
        found = [meminfo_available_bytes(_MEMINFO.read_text())]
    except OSError:
        found = []
    found += [cgroup_available_bytes(_read_int(limit), _read_int(used))
              for limit, used in _CGROUP_LIMITS]
    known = [b for b in found if b is not None]
    return min(known) if known else None
