"""tests/run_lanes.py (what `make test` and CI run): a test that fails beside the
other lanes runs once more alone, and the closing lines say so; a test that fails
alone too, or a lane that broke in another way, fails the suite. Driven over a small
suite written here, with the lanes replaced by two of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import run_lanes  # noqa: E402
from cluster.launcher.process_table import read_process  # noqa: E402

SUITE = '''
import os, pathlib
import pytest

def test_steady():
    pass

@pytest.mark.timing
def test_fails_the_first_time():
    marker = pathlib.Path(os.environ["LANES_TMP"]) / "ran-once"
    first = not marker.exists()
    marker.touch()
    # what a test that loads the machine on purpose reads (reliability_support.busy_core)
    pids_file = pathlib.Path(os.environ["STEPSTREAM_LANE_PIDS_FILE"])
    seen = pids_file.read_text() if pids_file.exists() else "absent"
    (marker.parent / ("lanes-seen-" + ("first" if first else "again"))).write_text(
        str(os.getpid()) + ":" + seen)
    assert not first, "first run"

@pytest.mark.timing
{last}
'''


def _suite(tmp_path: Path, body: str) -> list[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    timing: a test of this suite\n")
    (tmp_path / "test_small_suite.py").write_text(body)
    return [str(tmp_path), f"--rootdir={tmp_path}", "-p", "no:cacheprovider"]


@pytest.fixture
def two_lanes(monkeypatch, tmp_path):
    monkeypatch.setattr(run_lanes, "LANES", {"timing": ("timing", 0), "rest": ("not timing", 0)})
    monkeypatch.setenv("LANES_TMP", str(tmp_path))


def test_failed_tests_are_read_from_pytests_summary_lines():
    log = ("....F\nFAILED tests/a.py::test_x[1.0-several widths] - AssertionError: a - b\n"
           "ERROR tests/b.py::test_y - RuntimeError\nFAILED tests/a.py::test_z\n"
           "SKIPPED [2] tests/c.py:4: needs a CUDA device\n"
           "FAILED tests/a.py::test_x[1.0-several widths] - again\n")
    assert run_lanes._failed_tests(log) == ["tests/a.py::test_x[1.0-several widths]",
                                            "tests/b.py::test_y", "tests/a.py::test_z"]


NICENESS_SEEN = """def test_other():
    path = pathlib.Path(os.environ["LANES_TMP"]) / "worker-niceness-seen"
    path.write_text(os.environ.get("RAY_worker_niceness", "unset"))"""


def test_a_test_that_passes_alone_is_counted_passed_and_named(two_lanes, tmp_path, capsys,
                                                             monkeypatch):
    # Ray's default for its workers: 15 nicer than the lane that starts them
    monkeypatch.setenv("RAY_worker_niceness", "15")
    argv = _suite(tmp_path, SUITE.format(last=NICENESS_SEEN))
    assert run_lanes.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    assert lines[-1] == "3 passed, 0 failed, 0 skipped"
    assert "1 failed beside the other lanes and passed alone:" in out
    assert "test_small_suite.py::test_fails_the_first_time" in out.split("passed alone:")[1]
    # each lane sees every lane's pid, its own too; a test run alone sees none
    own_pid, pids = (tmp_path / "lanes-seen-first").read_text().split(":")
    assert own_pid in pids.split() and len(pids.split()) == 2
    assert (tmp_path / "lanes-seen-again").read_text().split(":")[1] == "absent"
    # each lane's Ray workers run at the lane's own priority, not 15 below it
    assert (tmp_path / "worker-niceness-seen").read_text() == "0"


def test_a_test_that_fails_alone_too_fails_the_suite(two_lanes, tmp_path, capsys):
    argv = _suite(tmp_path, SUITE.format(last="def test_always():\n    assert False"))
    assert run_lanes.main(argv) == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "2 passed, 1 failed, 0 skipped"
    assert "alone: FAILED" in out and "passed alone" not in out


def test_a_lane_that_breaks_otherwise_fails_at_once(two_lanes, tmp_path, capsys):
    argv = _suite(tmp_path, SUITE.format(last="def test_broken(:"))
    assert run_lanes.main(argv) == 2
    out = capsys.readouterr().out
    assert "===== alone" not in out


def _cpu_s(pid: int) -> float:
    return read_process(pid).cpu_s


def test_the_busy_loop_waits_while_another_lane_runs_then_spins(monkeypatch, tmp_path):
    import reliability_support

    other_lane = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        pids = tmp_path / "lane.pids"
        pids.write_text(f"{os.getpid()} {other_lane.pid}")
        monkeypatch.setenv(run_lanes.LANE_PIDS_FILE_ENV, str(pids))
        with reliability_support.busy_core() as loop:
            time.sleep(1.0)
            assert _cpu_s(loop.pid) < 0.5  # its start-up and 5 looks a second
            waited = _cpu_s(loop.pid)
            other_lane.kill()
            other_lane.wait()
            # NOTE: a bound on the wait, not a pace: at nice 10 beside two lanes it may
            # get little of a core, but it does get some
            deadline = time.monotonic() + 30
            while _cpu_s(loop.pid) < waited + 0.3 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _cpu_s(loop.pid) >= waited + 0.3, "the loop never spun after the lane ended"
    finally:
        other_lane.kill()
        other_lane.wait()
