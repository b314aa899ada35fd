"""A lone stream on a CPU machine gets every core: engine replicas that share a
machine say on a board whether they have work, and a replica with work while
every other one is idle, and no other process wants a core either, runs its steps
on all the cores.

Why: the local layout gives each engine replica one core's threads
(cluster/launcher/cpu_layout.py), which is what many streams need, but a decode
step of one stream reads every weight, and one core cannot pull the machine's
memory bandwidth alone. When the other replicas are idle their cores are too,
so the replica that has work takes them; as soon as another replica has work,
each goes back to its own share at its next step.

The board is a small shared-memory file of one row per engine process of this
user on this machine (pid, rows in its batch, last heartbeat). A process that
died keeps its row until its heartbeat is stale, then counts as idle, and its
row is claimed again.
"""
from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
import stat
import tempfile
import time

import numpy as np

logger = logging.getLogger("stepstream")

NUM_SLOTS = 64
PID, ROWS, HEARTBEAT = 0, 1, 2
# A row whose heartbeat is older than this counts as idle: its process died with work
STALE_NS = 5_000_000_000
BOARD_ENV = "STEPSTREAM_CORE_BOARD"
# (board path, slot) held by this process's open boards: a second engine in one
# process (tests, benchmarks) takes a row of its own
_HELD: set[tuple[str, int]] = set()


def default_board_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.environ.get(BOARD_ENV) or os.path.join(base, f"stepstream-engines-{os.getuid()}")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CoreBoard:
    """This process's row on the machine's board; raises OSError when the board
    cannot be opened safely (another user's file, or a shared one)."""

    def __init__(self, path: str | None = None):
        self.path = path or default_board_path()
        size = NUM_SLOTS * 3 * 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise OSError(f"{self.path} is not this user's private file")
            if info.st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
            self._fd = fd
        except BaseException:
            os.close(fd)
            raise
        self.rows = np.frombuffer(self._map, dtype=np.int64).reshape(NUM_SLOTS, 3)
        self.slot = self._claim()
        self._published: int | None = None

    def _claim(self) -> int:
        pid = os.getpid()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            for slot in range(NUM_SLOTS):
                owner = int(self.rows[slot, PID])
                mine_unheld = owner == pid and (self.path, slot) not in _HELD
                if owner == 0 or mine_unheld or (owner != pid and not _pid_alive(owner)):
                    self.rows[slot] = (pid, 0, time.monotonic_ns())
                    _HELD.add((self.path, slot))
                    return slot
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        raise OSError(f"{self.path}: all {NUM_SLOTS} rows are taken by live processes")

    def publish(self, num_rows: int) -> None:
        """Say how many rows this engine's batch has (0: idle); a heartbeat either way."""
        self.rows[self.slot, ROWS] = num_rows
        self.rows[self.slot, HEARTBEAT] = time.monotonic_ns()

    def others_idle(self) -> bool:
        """True when no other live row has work (a stale heartbeat counts as idle)."""
        now = time.monotonic_ns()
        rows = self.rows
        busy = (rows[:, PID] != 0) & (rows[:, ROWS] > 0) & (now - rows[:, HEARTBEAT] < STALE_NS)
        busy[self.slot] = False
        return not busy.any()

    def close(self) -> None:
        if self._map is None:
            return
        self.rows[self.slot] = (0, 0, 0)
        _HELD.discard((self.path, self.slot))
        self.rows = None
        try:
            self._map.close()
        except BufferError:  # a view of the rows is still alive: the collector closes it
            pass
        os.close(self._fd)
        self._map = None


# Other processes' threads wanting a core (averaged) past which a lone engine keeps
# to its own threads: beside a busy process its extra threads would wait on each
# other at the end of every op for a core that process holds, and slow it too. A
# lone stream's own HTTP side (ingress, proxy, a client) wants far less than this.
OTHERS_WANTING_CORES = 0.5
DEMAND_TAU_S = 0.25  # the average's time constant: a burst shorter than this hardly counts
DEMAND_SAMPLE_S = 0.01  # look no more often than this


def _runnable_now() -> int:
    """Threads of the whole machine running or waiting for a core now, the caller
    included (Linux: /proc/loadavg's fourth field)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


class MachineDemand:
    """How many threads of other processes want a core, averaged over about
    DEMAND_TAU_S: the machine's runnable threads less this engine's own. Demand,
    not CPU time: a process at a lower priority that this engine's threads keep from
    running still counts. The count is the kernel's, for the whole host: in a
    container on a busy shared host the replica keeps to its share. 0.0 where it
    cannot be read (not Linux): then the board alone decides."""

    def __init__(self, read_runnable=_runnable_now, clock=time.monotonic):
        self._read_runnable, self._clock = read_runnable, clock
        self.others = 0.0
        self._last: float | None = None

    def others_wanting_cores(self, own_threads: int) -> float:
        """`own_threads`: this engine's threads that may be running now (the caller,
        and the torch threads of its last step, which may still be spinning)."""
        now = self._clock()
        if self._last is not None and now - self._last < DEMAND_SAMPLE_S:
            return self.others
        try:
            others = max(0, self._read_runnable() - own_threads)
        except (OSError, ValueError, IndexError):
            return self.others
        weight = 1.0 if self._last is None else 1.0 - math.exp(-(now - self._last) / DEMAND_TAU_S)
        self.others += weight * (others - self.others)
        self._last = now
        return self.others


class StepThreads:
    """The torch thread count of each engine step: `own` threads while any other
    engine on the machine has work or other processes want its cores, every usable
    core while all are idle."""

    def __init__(self, own: int, board: CoreBoard, cores: int | None = None,
                 demand: MachineDemand | None = None):
        self.own, self.board = own, board
        self.cores = cores or usable_cores()
        self.demand = demand or MachineDemand()
        self.current = own

    @classmethod
    def for_engine(cls, own: int | None, enabled: bool, device: str) -> "StepThreads | None":
        """None when it does not apply: off, not on CPU, no thread count set, or the
        engine has every core already; also when the board cannot be opened (logged)."""
        if not enabled or device.split(":")[0] != "cpu" or own is None or own >= usable_cores():
            return None
        try:
            board = CoreBoard()
        except OSError as error:
            logger.warning("idle cores are not used: %s", error)
            return None
        logger.info("idle cores: %d thread(s), all %d cores while the machine's other "
                    "engine replicas are idle (board %s)", own, usable_cores(), board.path)
        return cls(own, board)

    def before_step(self, num_rows: int) -> int:
        """Publish this step's rows and set the step's thread count; returns it."""
        import torch

        self.board.publish(num_rows)
        others_want_cores = self.demand.others_wanting_cores(self.current) >= OTHERS_WANTING_CORES
        threads = self.cores if self.board.others_idle() and not others_want_cores else self.own
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
        return threads

    def idle(self) -> None:
        self.board.publish(0)

    def close(self) -> None:
        self.board.close()
