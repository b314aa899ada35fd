"""The benchmark client's own wait for a CPU (loadtests/serving/client_wait.py): measured on
its event loop, flagged in the result when it would distort the latencies."""
import asyncio
import io
import sys
import time

import pytest

from loadtests.serving.client_wait import LOOP_STALL_FLAG_S, WAIT_SHARE_FLAG, ClientWait, warning


def _measure(blocking_s: float) -> dict:
    async def run() -> dict:
        wait = ClientWait().start()
        await asyncio.sleep(0.05)
        time.sleep(blocking_s)  # the loop cannot tick meanwhile, as when the client cannot run
        await asyncio.sleep(0.05)
        return wait.take()
    return asyncio.run(run())


def test_a_loop_held_for_longer_than_the_flag_is_reported_with_the_stall():
    waited = _measure(LOOP_STALL_FLAG_S + 0.15)
    assert waited["client_longest_loop_stall_ms"] >= (LOOP_STALL_FLAG_S + 0.1) * 1000
    line = warning(waited, server_pid=4242)
    assert line is not None and line.startswith("warning: ")
    assert "echo 5 > /proc/4242/autogroup" in line and "ITL and TTFT" in line


def test_a_loop_left_to_tick_reports_its_wait_and_a_quiet_one_is_not_flagged():
    # NOTE: how long this loop really stalls depends on the machine's load (beside the
    # suite's other lanes, seconds at times), so the quiet case is made up
    waited = _measure(0.0)
    assert waited["client_longest_loop_stall_ms"] >= 0.0
    if sys.platform.startswith("linux"):  # the run-queue wait is Linux's schedstat
        assert 0.0 <= waited["client_cpu_wait_share"] <= 1.0
    else:
        assert waited["client_cpu_wait_share"] is None
    quiet = {**waited, "client_cpu_wait_share": 0.0, "client_longest_loop_stall_ms": 20.0}
    assert warning(quiet) is None


@pytest.mark.parametrize("share, stall_ms, flagged", [
    (WAIT_SHARE_FLAG * 2, 10.0, True),   # waited for a CPU, in many short waits
    (0.0, LOOP_STALL_FLAG_S * 2000, True),  # one long stall
    (None, LOOP_STALL_FLAG_S * 2000, True),  # not Linux: the stall alone says it
    (WAIT_SHARE_FLAG / 2, LOOP_STALL_FLAG_S * 500, False),
])
def test_either_measure_flags_the_result(share, stall_ms, flagged):
    line = warning({"client_cpu_wait_share": share, "client_longest_loop_stall_ms": stall_ms})
    assert (line is not None) is flagged
    if flagged:
        assert "/proc/<server pid>/autogroup" in line
        assert ("waited for a CPU" in line) is (share is not None)


def test_a_launched_server_session_yields_to_the_client(tmp_path):
    from loadtests.serving.local_server import LocalServer, session_autogroup

    if session_autogroup() is None:
        pytest.skip("this process's session has no autogroup of its own")
    with LocalServer(["--step-ms", "1"], module="loadtests.fake_server", model="fake",
                     log_path=tmp_path / "s.log", startup_timeout_s=30, session_nice=5) as srv:
        theirs = session_autogroup(srv.process.pid).split()
        ours = session_autogroup().split()
        assert theirs[0] != ours[0]  # a session, so an autogroup, of its own
        assert theirs[-1] == "5"
    with LocalServer(["--step-ms", "1"], module="loadtests.fake_server", model="fake",
                     log_path=tmp_path / "s2.log", startup_timeout_s=30) as srv:
        assert session_autogroup(srv.process.pid).split()[-1] == "0"


def test_a_stall_is_kept_with_its_times_so_a_gap_can_discount_it():
    async def run():
        wait = ClientWait().start()
        await asyncio.sleep(0.05)
        before = time.monotonic()
        time.sleep(0.3)
        await asyncio.sleep(0.05)
        after = time.monotonic()
        wait.take()
        return wait, before, after

    wait, before, after = asyncio.run(run())
    # NOTE: a loaded machine may add stalls of its own; the 0.3 s one is among them
    assert any(since <= before + 0.02 and to >= before + 0.3 for since, to in wait.stalls)
    # NOTE: + 1e-6: (before + 0.3) - before is not 0.3 in floats once the monotonic
    # clock reads tens of thousands of seconds (hours of uptime)
    assert 0.25 <= wait.stalled_within(before, before + 0.3) <= 0.3 + 1e-6
    assert wait.stalled_within(before, before + 0.1) == pytest.approx(0.1, abs=0.03)
    assert wait.stalled_within(after + 1.0, after + 2.0) == 0.0
    # two events around the stall: the gap between them, less the loop's own part
    gap, = wait.gaps_less_stalls([before, before + 0.4])
    assert 0.0 <= gap <= 0.11  # 0.4 if the stall were not taken out


def test_a_session_nice_the_kernel_asks_to_retry_is_set_on_a_later_try(monkeypatch, tmp_path):
    from loadtests.serving import local_server

    written, answers = [], [BlockingIOError(11, "again"), BlockingIOError(11, "again"), None]

    class _File:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            answer = answers.pop(0)
            if answer is not None:
                raise answer
            written.append(text)

    monkeypatch.setattr(local_server, "open", lambda path, mode: _File(), raising=False)
    assert local_server.set_session_nice(4242, 5) and written == ["5"]
    answers[:] = [PermissionError(1, "no")]
    assert not local_server.set_session_nice(4242, 5)


def test_a_session_without_an_autogroup_reads_as_none(monkeypatch):
    from loadtests.serving import local_server

    assert local_server.session_autogroup(2 ** 22 + 1) is None  # no such process
    # a session still in the boot-time group: the kernel shows the file empty
    monkeypatch.setattr(local_server, "open", lambda *a, **k: io.StringIO(""), raising=False)
    assert local_server.session_autogroup() is None
