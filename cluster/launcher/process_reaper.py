"""A watchdog that ends whatever a local launcher started once the launcher is gone,
however it went (Ctrl-C, SIGTERM, SIGKILL, a closed terminal).

Ray's workers and agents run in sessions of their own, so a signal to the
launcher's process group misses them; after a SIGKILL of the launcher Ray's
agents (and at times HAProxy, holding the HTTP port) stay behind. The launcher
starts this module as a child in a new session (`start`) and keeps the write end
of a pipe to it. While the pipe is open the reaper records, every
`poll_interval_s`, each process below the launcher (pid and start time, so a
reused pid is never touched); when the pipe closes (the launcher exited or died)
it waits `grace_s` for Ray's own clean-up, then sends SIGTERM, and SIGKILL
after `kill_after_s`, to every recorded process still alive. Linux only (/proc);
elsewhere `start` returns None.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from cluster.launcher import process_table
from cluster.launcher.process_table import read_process, read_process_table


def descendants(root_pid: int) -> dict[int, int]:
    """pid -> start time of every live process below `root_pid`."""
    table = read_process_table()
    return {pid: table[pid].start_ticks for pid in process_table.descendants(table, root_pid)}


def alive(recorded: dict[int, int]) -> dict[int, int]:
    """The recorded processes still running (same pid and start time)."""
    out = {}
    for pid, started in recorded.items():
        info = read_process(pid)
        if info is not None and info.start_ticks == started:
            out[pid] = started
    return out


def with_their_descendants(recorded: dict[int, int], me: int) -> dict[int, int]:
    """The recorded processes still alive and every live process below them.

    NOTE: once the launcher is gone, what Ray's processes start after the last look
    (the raylet's dashboard agent, a worker) is no longer below the launcher: it is
    below a recorded process, and would be left behind if only those were ended."""
    table = read_process_table()
    out = alive(recorded)
    for pid in list(out):
        out.update({p: table[p].start_ticks for p in process_table.descendants(table, pid)
                    if p != me})
    return out


def _signal_all(recorded: dict[int, int], sig: int) -> None:
    for pid in alive(recorded):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def watch(launcher_pid: int, pipe_fd: int, poll_interval_s: float = 1.0, grace_s: float = 3.0,
          kill_after_s: float = 5.0) -> dict[int, int]:
    """Record the launcher's descendants until `pipe_fd` closes, then end those
    still alive; returns the ones that were alive at the end of the grace period."""
    recorded: dict[int, int] = {}
    me = os.getpid()
    launcher = read_process(launcher_pid)
    while launcher is not None:
        # NOTE: only the living: short-lived helpers would otherwise pile up.
        recorded = alive(recorded)
        recorded.update({p: s for p, s in descendants(launcher_pid).items() if p != me})
        ready, _, _ = select.select([pipe_fd], [], [], poll_interval_s)
        if ready and not os.read(pipe_fd, 4096):
            break  # EOF: the launcher is gone
        # NOTE: also by its pid, in case a process forked without exec kept the pipe open.
        now = read_process(launcher_pid)
        if now is None or now.start_ticks != launcher.start_ticks:
            break
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        recorded = with_their_descendants(recorded, me)
        if not recorded:
            break
        time.sleep(0.2)
    left = with_their_descendants(recorded, me)
    if left:
        _signal_all(left, signal.SIGTERM)
        deadline = time.monotonic() + kill_after_s
        while time.monotonic() < deadline:
            left = {**left, **with_their_descendants(left, me)}
            if not alive(left):
                break
            time.sleep(0.2)
        _signal_all(with_their_descendants(left, me), signal.SIGKILL)
    return left


def start() -> subprocess.Popen | None:
    """Start the reaper for this process; it holds on to the pipe we keep open.
    NOTE: the write end must stay open in this process only (close_fds, and the
    pipe is not inheritable by Ray's processes)."""
    if not os.path.isdir("/proc/self"):
        return None
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, False)
    # NOTE: cwd: the package root, so `-m cluster.launcher.process_reaper` imports wherever
    # the launcher was started from.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.launcher.process_reaper", str(os.getpid()), str(read_fd)],
        pass_fds=(read_fd,), stdin=subprocess.DEVNULL, start_new_session=True, cwd=root)
    os.close(read_fd)
    proc._stepstream_pipe = write_fd  # kept open for this process's whole life
    return proc


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's
    watch(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
