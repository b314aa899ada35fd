"""The contention probe (loadtests/core_contention.py): a one-thread step on one core,
alone and beside each neighbour on another; it asserts what it measured, never how fast."""
import os
import subprocess

import pytest

from loadtests import core_contention
from loadtests.core_contention import NEIGHBOURS, measure, neighbour_command, start_neighbour

TINY_STEP = [(64, 96, 2), (96, 64, 1)]  # (in, out, uses per step)
affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")


def _cores() -> int:
    return len(core_contention.usable_core_ids())


@pytest.mark.slow
@affinity
@pytest.mark.skipif(_cores() < 2, reason="needs two usable cores")
def test_each_row_is_measured_and_its_neighbour_is_gone_after(monkeypatch):
    import torch

    started = []

    def start(*args):
        started.append(start_neighbour(*args))
        return started[-1]

    monkeypatch.setattr(core_contention, "start_neighbour", start)
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    rows = measure(TINY_STEP, batch=8, rounds=1, seconds=0.1)
    assert list(rows) == ["alone", *NEIGHBOURS]
    assert rows["alone"]["x_alone"] == 1.0
    assert all(row["steps_per_s"] > 0 and len(row["rounds"]) == 1 for row in rows.values())
    # this process runs where and as it did before
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
    assert len(started) == len(NEIGHBOURS) and all(p.poll() is not None for p in started)


@affinity
def test_a_neighbour_works_on_its_core_and_leaves_with_its_parent():
    core = sorted(os.sched_getaffinity(0))[-1]
    proc = start_neighbour("python", core, TINY_STEP, 8)
    try:
        assert os.sched_getaffinity(proc.pid) == {core}
        assert proc.poll() is None  # working until killed
        proc.stdin.close()  # what its parent's end does
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_one_core_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setattr(core_contention, "usable_core_ids", lambda: [0])
    with pytest.raises(SystemExit, match="needs two usable cores"):
        measure(TINY_STEP, batch=8)


def test_an_unknown_neighbour_is_refused():
    command = neighbour_command("disk", 0, [], 1)
    out = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "invalid choice" in out.stderr
