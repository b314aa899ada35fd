"""`python -m cluster.serve_local` (what `make serve` runs) stopped with SIGTERM
shuts Serve, then Ray, down and exits 0, leaving no process of its group behind.
(Ray installs its own SIGTERM handler, which exits 15 without a clean shutdown;
the launcher takes the signal back after `ray.init`.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cluster_support import free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_sigterm_shuts_serve_then_ray_down_and_exits_0(tmp_path):
    log = tmp_path / "serve_local.log"
    env = {k: v for k, v in os.environ.items() if k != "STEPSTREAM_API_KEY"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.serve_local", "--port", str(free_port()),
             "--num-cpus", "2", "--max-num-seqs", "4", "--num-kv-blocks", "64",
             "--max-model-len", "256"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while b"Serving at" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert text.index("Shutting down") < text.index("Stopped")
        assert "No API key" in text  # no key: loopback only, with a warning
        deadline = time.monotonic() + 30
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_alive(proc.pid), "Ray's processes outlived the launcher"
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
