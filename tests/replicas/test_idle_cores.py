"""A CPU engine replica with work takes every core while the machine's other
engine replicas are idle and no other process wants a core, and its own share as
soon as one does."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from replicas import idle_cores
from replicas.idle_cores import CoreBoard, MachineDemand, StepThreads


class _Demand:
    """Other processes' demand as a test sets it (beside the suite's other lanes the
    machine's own would keep every engine to its share)."""

    def __init__(self, others: float = 0.0):
        self.others = others

    def others_wanting_cores(self, own_threads: int) -> float:
        return self.others


@pytest.fixture
def board_path(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "board")
    monkeypatch.setenv(idle_cores.BOARD_ENV, path)
    return path


def test_a_board_sees_the_other_rows_work(board_path):
    mine, other = CoreBoard(), CoreBoard()
    assert mine.slot != other.slot
    assert mine.others_idle()
    other.publish(3)
    assert not mine.others_idle() and other.others_idle()
    other.publish(0)
    assert mine.others_idle()
    other.close()


def test_a_stale_or_dead_row_counts_as_idle_and_is_claimed_again(board_path, monkeypatch):
    mine = CoreBoard()
    # a process that died with work: its pid is gone and its heartbeat stops
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    free = (mine.slot + 1) % idle_cores.NUM_SLOTS
    mine.rows[free] = (dead_pid, 5, time.monotonic_ns())
    assert not mine.others_idle()  # fresh heartbeat: believed busy for now
    mine.rows[free, idle_cores.HEARTBEAT] = time.monotonic_ns() - idle_cores.STALE_NS - 1
    assert mine.others_idle()
    assert CoreBoard().slot == free  # the dead process's row is taken again


def test_a_board_another_user_could_write_is_not_used(board_path):
    with open(board_path, "wb") as f:
        f.write(b"\0" * 8)
    os.chmod(board_path, 0o666)
    with pytest.raises(OSError, match="private"):
        CoreBoard()
    assert StepThreads.for_engine(1, True, "cpu") is None or idle_cores.usable_cores() <= 1


def test_step_threads_follow_the_other_engines(board_path):
    original = torch.get_num_threads()
    try:
        demand = _Demand()
        threads = StepThreads(1, CoreBoard(), cores=2, demand=demand)
        other = CoreBoard()
        assert threads.before_step(1) == 2 and torch.get_num_threads() == 2
        other.publish(4)
        assert threads.before_step(1) == 1 and torch.get_num_threads() == 1
        other.publish(0)
        assert threads.before_step(1) == 2
        demand.others = 1.0  # another program's thread wants a core
        assert threads.before_step(1) == 1 and torch.get_num_threads() == 1
        threads.idle()
        assert other.others_idle()
    finally:
        torch.set_num_threads(original)


def test_it_applies_only_on_cpu_with_a_share_below_the_cores(board_path):
    cores = idle_cores.usable_cores()
    assert StepThreads.for_engine(None, True, "cpu") is None
    assert StepThreads.for_engine(1, False, "cpu") is None
    assert StepThreads.for_engine(1, True, "cuda") is None
    assert StepThreads.for_engine(cores, True, "cpu") is None
    if cores > 1:
        assert StepThreads.for_engine(1, True, "cpu") is not None


@pytest.mark.skipif(idle_cores.usable_cores() < 2, reason="one core: nothing to take")
def test_an_engine_alone_steps_on_every_core_and_on_its_share_beside_a_busy_one(board_path,
                                                                              monkeypatch):
    from replicas import Engine, EngineConfig, SamplingParams

    monkeypatch.setattr(idle_cores, "MachineDemand", _Demand)  # a machine idle but for it

    seen: list[int] = []
    with Engine(EngineConfig(model="tiny", num_threads=1)) as engine:
        runner = engine.core.runner
        forward = runner.model.forward

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return forward(*args, **kwargs)

        runner.model.forward = spy
        params = SamplingParams(temperature=0.0, max_tokens=4)
        engine.generate([[5, 6, 7]], params)
        alone = set(seen)
        seen.clear()
        busy = CoreBoard()
        busy.publish(2)
        engine.generate([[8, 9, 10]], params)
        beside_busy = set(seen)
        busy.close()
        rows = engine.core.step_threads.board.rows
        assert rows[engine.core.step_threads.board.slot, idle_cores.ROWS] == 0  # idle again
    assert alone == {idle_cores.usable_cores()}
    assert beside_busy == {1}


def test_demand_is_other_threads_wanting_a_core_averaged_over_a_quarter_second():
    now, runnable = [0.0], [1]
    demand = MachineDemand(read_runnable=lambda: runnable[0], clock=lambda: now[0])
    assert demand.others_wanting_cores(1) == 0.0  # only the caller runs
    runnable[0] = 2  # another process's thread, for a second
    for _ in range(100):
        now[0] += 0.01
        value = demand.others_wanting_cores(1)
    assert value > 0.95
    runnable[0] = 3  # the engine's second thread may still spin: its own, not another's
    assert demand.others_wanting_cores(2) == value  # looked at less than 10 ms ago
    now[0] += 0.01
    assert 0.95 < demand.others_wanting_cores(2) <= 1.0
    runnable[0] = 1
    now[0] += 0.02  # a blip: the average hardly moves
    assert demand.others_wanting_cores(1) > 0.9
    now[0] += 1.0
    assert demand.others_wanting_cores(1) < 0.05


def test_demand_where_the_machine_cannot_be_read_leaves_the_board_to_decide():
    def unreadable():
        raise OSError("no /proc")
    assert MachineDemand(read_runnable=unreadable).others_wanting_cores(1) == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads /proc/loadavg")
def test_a_busy_process_at_a_lower_priority_is_seen_wanting_a_core():
    """Demand, not CPU time: a niced loop that an engine's threads would keep from
    running still counts (the suite's other lanes only add to it)."""
    loop = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        samples = sorted(idle_cores._runnable_now() for _ in range(50))
    finally:
        loop.kill()
        loop.wait()
    assert samples[len(samples) // 2] >= 2  # this thread and the loop
