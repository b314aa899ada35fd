"""How long the benchmark client itself waited for a CPU during a run.

A client on the server's machine competes with the server for the cores. Where the
kernel schedules by autogroup (each session one group, as on this project's
machines), a busy server's session can keep the client's session off the CPU for
seconds at a time: the events pile up in the client's sockets and are read in one
burst, so the burst's inter-token latencies read ~0 ms and the latency before it
reads seconds. Neither is the server's doing. `ClientWait` measures that wait from
the client's side so a result can say when its latencies are not the server's:
- the run-queue wait of the client's event-loop thread (Linux:
  `/proc/self/task/<tid>/schedstat`, the time it was runnable but not running);
- the longest stall of the client's event loop, from a 10 ms timer task (any OS),
  and each stall's times, so that a reader can take its own stalls out of the gaps
  it timed (`stalled_within`, `gaps_less_stalls`; the burst test does).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

TICK_S = 0.01
STALL_KEPT_S = 0.05  # stalls kept with their times (stalled_within)
# NOTE: a result is flagged when the client waited for a CPU this share of the run,
# or its loop stalled this long: a stall past a step's time merges steps' events.
WAIT_SHARE_FLAG = 0.05
LOOP_STALL_FLAG_S = 0.25


def _runqueue_wait_s() -> float | None:
    """Seconds this thread has spent runnable but not running, where Linux says."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


@dataclass(slots=True)
class ClientWait:
    """`start()` on the client's event loop before the run, `take()` after it."""
    _started_at: float = 0.0
    _wait_before: float | None = None
    _longest_stall_s: float = 0.0
    _ticker: asyncio.Task | None = field(default=None, repr=False)
    # (from, to) on time.monotonic() of each stall past STALL_KEPT_S: when the loop
    # should have ticked and when it did
    stalls: list[tuple[float, float]] = field(default_factory=list)

    def start(self) -> "ClientWait":
        self._started_at = time.monotonic()
        self._wait_before = _runqueue_wait_s()
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            stall = now - last - TICK_S
            self._longest_stall_s = max(self._longest_stall_s, stall)
            if stall > STALL_KEPT_S:
                self.stalls.append((last + TICK_S, now))
            last = now

    def stalled_within(self, start: float, end: float) -> float:
        """Seconds of [start, end] (time.monotonic()) this loop was stalled: the
        part of a gap between two events that was the reader's own."""
        return sum(max(0.0, min(end, to) - max(start, since)) for since, to in self.stalls)

    def gaps_less_stalls(self, times: list[float]) -> list[float]:
        """The gaps between consecutive event times (time.monotonic()), each less the
        time this loop was stalled within it: the sender's part of each gap."""
        return [b - a - self.stalled_within(a, b) for a, b in zip(times, times[1:])]

    def take(self) -> dict:
        """{"client_cpu_wait_s", "client_cpu_wait_share" (None off Linux),
        "client_longest_loop_stall_ms"}."""
        if self._ticker is not None:
            self._ticker.cancel()
        elapsed = max(time.monotonic() - self._started_at, 1e-9)
        wait_after = _runqueue_wait_s()
        wait = (None if self._wait_before is None or wait_after is None
                else wait_after - self._wait_before)
        return {"client_cpu_wait_s": wait,
                "client_cpu_wait_share": None if wait is None else wait / elapsed,
                "client_longest_loop_stall_ms": self._longest_stall_s * 1000}


def warning(wait: dict, server_pid: int | None = None) -> str | None:
    """A line for the result when the client's own waiting distorts its latencies."""
    share = wait.get("client_cpu_wait_share")
    stall_ms = wait.get("client_longest_loop_stall_ms") or 0.0
    if (share is None or share <= WAIT_SHARE_FLAG) and stall_ms <= LOOP_STALL_FLAG_S * 1000:
        return None
    what = (f"the benchmark client's event loop stalled up to {stall_ms:.0f} ms"
            if share is None else f"the benchmark client waited for a CPU {share:.1%} of the "
            f"run, and its event loop stalled up to {stall_ms:.0f} ms")
    where = f"/proc/{server_pid}/autogroup" if server_pid else "/proc/<server pid>/autogroup"
    return (f"warning: {what}: events queued in its sockets meanwhile, so its ITL and TTFT "
            "include its own wait, not only the server's. Run the client on another "
            "machine, or run the server in a session of its own (another terminal, or "
            f"setsid) and lower that session's priority (echo 5 > {where}, or more; "
            "`bench compare` and `bench http` start their servers at 5).")
