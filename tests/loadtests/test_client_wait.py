"""The benchmark client's own wait for a CPU (loadtests/client_wait.py): measured on
its event loop, flagged in the result when it would distort the latencies."""
import asyncio
import os
import sys
import time

import pytest

from loadtests.client_wait import LOOP_STALL_FLAG_S, WAIT_SHARE_FLAG, ClientWait, warning


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


def test_a_loop_that_ticks_on_time_is_not_flagged():
    waited = _measure(0.0)
    assert waited["client_longest_loop_stall_ms"] < LOOP_STALL_FLAG_S * 1000
    if sys.platform.startswith("linux"):  # the run-queue wait is Linux's schedstat
        assert 0.0 <= waited["client_cpu_wait_share"] < 1.0
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


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroup scheduling here")
def test_a_launched_server_session_yields_to_the_client(tmp_path):
    from loadtests.local_server import LocalServer

    with LocalServer(["--step-ms", "1"], module="loadtests.fake_server", model="fake",
                     log_path=tmp_path / "s.log", startup_timeout_s=30, session_nice=5) as srv:
        theirs = open(f"/proc/{srv.process.pid}/autogroup").read().split()
        ours = open("/proc/self/autogroup").read().split()
        assert theirs[0] != ours[0]  # a session, so an autogroup, of its own
        assert theirs[-1] == "5"
    with LocalServer(["--step-ms", "1"], module="loadtests.fake_server", model="fake",
                     log_path=tmp_path / "s2.log", startup_timeout_s=30) as srv:
        assert open(f"/proc/{srv.process.pid}/autogroup").read().split()[-1] == "0"


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
    assert len(wait.stalls) == 1
    assert 0.25 <= wait.stalled_within(before - 1.0, after + 1.0) <= after - before
    assert wait.stalled_within(before, before + 0.1) == pytest.approx(0.1, abs=0.03)
    assert wait.stalled_within(after + 1.0, after + 2.0) == 0.0
