"""`python -m loadtests.bench start-beside-busy`: its variants, and a run against the fake
server (no Ray) that starts, times and stops it beside a busy loop, in this session."""
from __future__ import annotations

import argparse
import os

import pytest

from loadtests.local_server import LocalServer
from loadtests.bench import main
from loadtests.start_beside_busy import parse_variant


def test_a_variant_is_a_name_and_the_launchers_environment():
    assert parse_variant("default=") == ("default", {})
    assert parse_variant("ray nice 15=RAY_worker_niceness=15 X=a=b") == (
        "ray nice 15", {"RAY_worker_niceness": "15", "X": "a=b"})
    with pytest.raises(argparse.ArgumentTypeError, match="is not KEY=VALUE"):
        parse_variant("bad=NOVALUE")


def test_it_times_each_variant_of_the_server_it_is_given(capsys):
    assert main(["start-beside-busy", "--busy", "1", "--module", "loadtests.fake_server", "--timeout-s", "60",
                 "--variant", "default=", "--variant", "other=SOME_VAR=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("1 busy loops, default: ") and lines[0].endswith(" s"), lines
    assert lines[1].startswith("1 busy loops, other: ") and lines[1].endswith(" s"), lines


def test_a_server_in_this_session_gets_a_process_group_that_stopping_ends():
    with LocalServer([], module="loadtests.fake_server", own_session=False,
                     startup_timeout_s=60) as server:
        pid = server.process.pid
        assert os.getsid(pid) == os.getsid(0) and os.getpgid(pid) == pid
    assert server.process.poll() is not None
