"""The host memory a CPU engine may still take, read once at start-up.

The CPU KV cache's default size is a share of this (replicas/kv_cache/kv_budget.py),
so that a replica started on a small machine does not take memory that is not there.
A container's or a service's memory limit counts as much as the machine's: the
smallest wins. Within a cgroup, reclaimable file cache (the model's weights just read,
for one) does not count as used, as the kernel would give it back. Pure Python, no
torch.
"""
from __future__ import annotations

from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
_SELF_CGROUP = Path("/proc/self/cgroup")
_CGROUP_V2_ROOT = Path("/sys/fs/cgroup")
_CGROUP_V1_MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
# cgroup v1 writes "no limit" as a huge number near 2**63
_NO_LIMIT = 2**60


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    text = text.strip() if text is not None else ""
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def meminfo_available_bytes(meminfo_text: str) -> int | None:
    """MemAvailable from /proc/meminfo's text (kB), None when it is not there."""
    for line in meminfo_text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) >= 2 and fields[1].isdigit() else None
    return None


def stat_value(stat_text: str | None, key: str) -> int:
    """A counter of a cgroup's memory.stat text, 0 when it is not there."""
    for line in (stat_text or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == key and fields[1].isdigit():
            return int(fields[1])
    return 0


def cgroup_available_bytes(limit: int | None, used: int | None, reclaimable: int = 0) -> int | None:
    """What a cgroup's limit leaves, its reclaimable file cache not counted as used;
    None when it sets no limit."""
    if limit is None or used is None or limit >= _NO_LIMIT:
        return None
    return max(0, limit - max(0, used - reclaimable))


def own_cgroup_paths(self_cgroup_text: str) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory controller path) of /proc/self/cgroup's text."""
    v2 = v1 = None
    for line in self_cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _own_dir(root: Path, path: str | None) -> Path:
    # NOTE: inside a cgroup namespace the path is "/" or not under the mount: then the
    # mount's root is the process's own cgroup
    own = root / path.lstrip("/") if path else root
    return own if own.is_dir() else root


def _cgroup_v2_available(path: str | None) -> list[int]:
    """Every limit from the process's cgroup up to the root: a parent's binds too."""
    found, level = [], _own_dir(_CGROUP_V2_ROOT, path)
    while True:
        available = cgroup_available_bytes(
            _read_int(level / "memory.max"), _read_int(level / "memory.current"),
            stat_value(_read(level / "memory.stat"), "inactive_file"))
        if available is not None:
            found.append(available)
        if level == _CGROUP_V2_ROOT or level.parent == level:
            return found
        level = level.parent


def _cgroup_v1_available(path: str | None) -> list[int]:
    """hierarchical_memory_limit already holds the parents' limits."""
    level = _own_dir(_CGROUP_V1_MEMORY_ROOT, path)
    stat = _read(level / "memory.stat")
    limit = stat_value(stat, "hierarchical_memory_limit") or _read_int(level / "memory.limit_in_bytes")
    available = cgroup_available_bytes(limit, _read_int(level / "memory.usage_in_bytes"),
                                       stat_value(stat, "total_inactive_file"))
    return [] if available is None else [available]


def available_host_bytes() -> int | None:
    """The memory this process may still allocate: the machine's MemAvailable, or what
    its cgroups' limits leave when less. None where neither can be read (not Linux)."""
    meminfo = _read(_MEMINFO)
    found = [] if meminfo is None else [meminfo_available_bytes(meminfo)]
    v2_path, v1_path = own_cgroup_paths(_read(_SELF_CGROUP) or "")
    found += _cgroup_v2_available(v2_path) + _cgroup_v1_available(v1_path)
    known = [b for b in found if b is not None]
    return min(known) if known else None
