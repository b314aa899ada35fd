"""The HTTP side's processes (HAProxy, the ingress replicas) run under Linux's
SCHED_BATCH policy, unless `STEPSTREAM_HTTP_SCHED_BATCH=0`.

Why: each step, the ingress writes one SSE event to each stream's connection, and
every write wakes HAProxy (and HAProxy's writes wake the client). Under the default
policy a woken task preempts the writer where no core is idle, so on a machine
whose cores the engine shares with the HTTP side every event costs two context
switches per hop. A SCHED_BATCH task does not preempt on wakeup: it waits for the
running task to block or for the scheduler's tick, so the ingress writes a step's
events to all its connections before HAProxy runs, and HAProxy takes them in one
pass of its event loop. Likewise the ingress, woken by an engine replica's step
message, waits for the running task's slice (a few ms at most) where every core is
busy. Where a core is idle a woken task runs there at once, as before. Niceness,
affinity and CPU shares stay as they were.

Imports nothing of cluster/: `stepstream-haproxy` runs it before exec'ing HAProxy
at every start and reload, and the ingress replica in its constructor.
"""
from __future__ import annotations

import os

SCHED_BATCH_ENV = "STEPSTREAM_HTTP_SCHED_BATCH"  # "0": leave the default policy
_MAX_PASSES = 4  # over the process's threads


def wanted(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(SCHED_BATCH_ENV, "1").strip() != "0"


def batch_this_process(environ: dict[str, str] | None = None) -> int:
    """Every thread of this process to SCHED_BATCH where `wanted`; threads started
    later inherit it from the thread that starts them. Returns how many threads
    changed (0 off Linux, or where not wanted).

    NOTE: moving between SCHED_OTHER and SCHED_BATCH needs no privilege; a thread
    that ended meanwhile, or one that cannot be changed, is skipped: the policy is
    an optimisation, never a reason to fail a start."""
    if not wanted(environ) or not hasattr(os, "SCHED_BATCH"):
        return 0
    done: set[int] = set()
    changed = 0
    # NOTE: again until no thread is new: one started meanwhile by a thread not yet
    # changed would keep the default policy
    for _ in range(_MAX_PASSES):
        try:
            thread_ids = {int(tid) for tid in os.listdir("/proc/self/task")} - done
        except OSError:
            thread_ids = {0} - done  # 0: the calling thread
        if not thread_ids:
            break
        for tid in thread_ids:
            done.add(tid)
            try:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                continue
            changed += 1
    return changed
