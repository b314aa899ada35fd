"""`bench http-floor`: each server streams every event to every stream, and each row
says what it cost per event (small and quick here: a few streams, a few events)."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtests import bench, http_floor

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="reads CPU time from /proc")


def test_every_row_streams_every_event_and_is_costed(capsys):
    rows = bench.main(["http-floor", "--streams", "3", "--events", "4", "--rounds", "1",
                       "--interval-ms", "5", "--haproxy-threads", "1"])
    expected = {"bare ASGI", "FastAPI StreamingResponse"}
    if http_floor.haproxy_binary() is not None:
        expected.add("bare ASGI via HAProxy, 1 thread")
    assert set(rows) == expected
    for name, row in rows.items():
        assert row["events"] == 3 * (4 + 1), name  # every chunk and [DONE]
        assert row["server_us"] >= 0  # NOTE: /proc counts in ticks: a short run may read 0
    if "bare ASGI via HAProxy, 1 thread" in rows:
        assert rows["bare ASGI via HAProxy, 1 thread"]["haproxy_us"] >= 0
    out = capsys.readouterr().out
    assert "3 streams x 4 events" in out and "| bare ASGI " in out


def test_the_haproxy_config_is_what_serve_runs_for_streams():
    config = http_floor.haproxy_config(8001, 9001, 2)
    for line in ("nbthread 2", "mode http", "option http-no-delay", "option splice-response",
                 "bind 127.0.0.1:8001", "server s1 127.0.0.1:9001"):
        assert line in config
