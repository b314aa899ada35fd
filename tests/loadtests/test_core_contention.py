"""The contention probe (loadtests/core_contention.py): a one-thread step on one core,
alone and beside each neighbour on another; it asserts what it measured, never how fast."""
import os
import subprocess
import sys

import pytest

from loadtests import core_contention
from loadtests.core_contention import NEIGHBOURS, measure, start_neighbour

TINY_STEP = [(64, 96, 2), (96, 64, 1)]  # (in, out, uses per step)


def _cores() -> int:
    return len(core_contention.usable_cores())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or _cores() < 2, reason="needs two usable cores")
def test_each_row_is_measured_and_the_neighbours_are_gone_after():
    before = os.sched_getaffinity(0)
    rows = measure(TINY_STEP, batch=8, rounds=1, seconds=0.1)
    assert list(rows) == ["alone", *NEIGHBOURS]
    assert rows["alone"]["x_alone"] == 1.0
    assert all(row["steps_per_s"] > 0 and len(row["rounds"]) == 1 for row in rows.values())
    assert os.sched_getaffinity(0) == before  # this process may run anywhere again
    mine = subprocess.run(["pgrep", "-f", "loadtests.core_contention --neighbour"], capture_output=True)
    assert mine.stdout.strip() == b""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_a_neighbour_runs_on_the_core_it_was_given():
    core = sorted(os.sched_getaffinity(0))[-1]
    proc = start_neighbour("python", core, TINY_STEP, 8)
    try:
        assert os.sched_getaffinity(proc.pid) == {core}
        assert proc.poll() is None  # working until killed
    finally:
        proc.kill()
        proc.wait()


def test_one_core_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setattr(core_contention, "usable_cores", lambda: [0])
    with pytest.raises(SystemExit, match="needs two usable cores"):
        measure(TINY_STEP, batch=8)


def test_an_unknown_neighbour_is_refused():
    out = subprocess.run([sys.executable, "-m", "loadtests.core_contention", "--neighbour", "disk",
                          "--core", "0", "--products", "[]", "--batch", "1"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice" in out.stderr
