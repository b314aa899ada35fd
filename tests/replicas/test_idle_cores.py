"""A CPU engine replica with work takes every core while the machine's other
engine replicas are idle, and its own share as soon as one has work."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from replicas import idle_cores
from replicas.idle_cores import CoreBoard, StepThreads


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
        threads = StepThreads(1, CoreBoard(), cores=2)
        other = CoreBoard()
        assert threads.before_step(1) == 2 and torch.get_num_threads() == 2
        other.publish(4)
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
def test_an_engine_alone_steps_on_every_core_and_on_its_share_beside_a_busy_one(board_path):
    from replicas import Engine, EngineConfig, SamplingParams

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
