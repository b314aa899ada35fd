"""The locust file, headless in a subprocess, against the fake SSE server.

Locust is never imported here: it monkey-patches the whole process with gevent.
"""
import pytest
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from loadtests.fake_server import FakeServerConfig, FakeServerThread

pytestmark = pytest.mark.slow  # locust runs: not in `make test-fast`

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtests" / "locustfile.py"


def _locust(args: list[str], cwd: Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCUST_SHAPE", None)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def _stats(prefix: Path) -> dict[tuple[str, str], dict]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def test_headless_run_records_ttft_itl_tpot_without_failures(tmp_path):
    with FakeServerThread(FakeServerConfig(step_ms=2.0)) as srv:
        proc = _locust(["-u", "4", "-r", "4", "--run-time", "5s", "--host", srv.base_url,
                        "--csv", str(tmp_path / "run"), "--output-len", "12", "--input-len", "16",
                        "--chat-ratio", "0.5", "--model", "fake"], tmp_path)
        served = srv.server.num_requests
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = _stats(tmp_path / "run")
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        post = stats[("POST", endpoint)]
        assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0
        ttft, itl, tpot = (stats[(kind, endpoint)] for kind in ("TTFT", "ITL", "TPOT"))
        assert int(ttft["Request Count"]) == int(post["Request Count"])  # one TTFT a request
        assert int(itl["Request Count"]) == 11 * int(post["Request Count"])  # 12 chunks: 11 gaps
        assert int(tpot["Request Count"]) == int(post["Request Count"])
        # the request's time covers the whole stream (12 steps of 2 ms), not just the headers
        assert float(post["Average Response Time"]) >= 20.0
    num_posts = sum(int(stats[("POST", e)]["Request Count"]) for e in ("/v1/completions", "/v1/chat/completions"))
    assert served >= num_posts
    # TTFT, ITL and TPOT rows are no requests: the Aggregated row counts real ones only
    assert int(stats[("", "Aggregated")]["Request Count"]) == num_posts


def test_staged_shape_stops_by_itself_and_failures_carry_their_reason(tmp_path):
    with FakeServerThread(FakeServerConfig(step_ms=1.0, fail_every=4, failure="cut")) as srv:
        start = time.monotonic()
        proc = _locust(["--shape", "staged", "--peak-users", "2", "--ramp-time", "0.5", "--hold-time", "1.5",
                        "--host", srv.base_url, "--csv", str(tmp_path / "shape"), "--output-len", "6"],
                       tmp_path, timeout_s=45.0)
        elapsed = time.monotonic() - start
    assert "Shape test completed" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 30.0
    post = _stats(tmp_path / "shape")[("POST", "/v1/completions")]
    assert int(post["Failure Count"]) > 0
    with open(tmp_path / "shape_failures.csv", newline="") as f:
        errors = {row["Error"] for row in csv.DictReader(f)}
    assert errors and all("stream ended without [DONE]" in e for e in errors), errors


def test_soak_out_writes_per_minute_counts_and_exact_percentiles(tmp_path):
    out = tmp_path / "minutes.json"
    with FakeServerThread(FakeServerConfig(step_ms=1.0, fail_every=5)) as srv:
        # NOTE: 8 s: locust's own start took all of 3 s once on a busy machine (no request)
        proc = _locust(["-u", "2", "-r", "2", "--run-time", "8s", "--host", srv.base_url,
                        "--output-len", "5", "--soak-out", str(out)], tmp_path)
        served = srv.server.num_requests
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: some requests failed, as asked
    summary = json.loads(out.read_text())
    # every 5th request the server got failed (HTTP 500); those in flight at the end are lost
    assert 0 < summary["requests"] <= served
    assert abs(summary["failures"] - summary["requests"] / 5) <= 2
    assert [m["minute"] for m in summary["per_minute"]] == [0]
    assert summary["ttft"]["count"] == summary["requests"] - summary["failures"]
    assert summary["itl"]["count"] == 4 * summary["ttft"]["count"]  # 5 chunks: 4 gaps
    assert 0 < summary["ttft"]["median_ms"] <= summary["ttft"]["p99_ms"] <= summary["ttft"]["max_ms"]
